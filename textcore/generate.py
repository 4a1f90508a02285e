"""Batched generation with the KimiLinear trunk: one prefill, then one token per step per sequence.

Prompts of different lengths are left-padded; the pad positions change no KDA state and are never
attended by MLA, so every sequence gets exactly the logits it would get alone. Prompts are token
ids or embeddings (the service splices image embeddings into `embed_tokens(ids)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from textcore.config import END_OF_MSG
from textcore.model import KimiLinearForCausalLM


class SamplingError(ValueError):
    """A sampling parameter out of its range; the message names the field and the value."""

    kind = "bad_input"  # in the service's error taxonomy (service.errors.Kind)


# Below this a temperature is greedy, as in vLLM (its _SAMPLING_EPS): dividing the logits by it
# would overflow float32 and give NaN probabilities.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range (and vLLM's): above it float32 logits / T lose all contrast, then overflow


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the one place the ranges are checked (every face reports its `SamplingError`).

    `max_new_tokens` None: as many as the model length leaves after the prompt (the caller, who
    knows the prompt, resolves it before generating)."""

    max_new_tokens: int | None = 256
    temperature: float = 0.0  # 0 = greedy (so is anything below GREEDY_BELOW)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = (END_OF_MSG,)

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise SamplingError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


@dataclass
class Generation:
    tokens: list[int]  # generated ids, without the stop token
    finish_reason: str  # "stop" (a stop token came) or "length" (max_new_tokens reached)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """logits `[B, vocab]` -> ids `[B]`: greedy at temperature 0, else top-k, then top-p, then draw."""
    if params.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[..., 0] = False  # also when top_p rounds to 0 in float32 (5e-324)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _left_pad(prompts: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack `[T_i, ...]` prompts into `[B, T, ...]` with left padding (zeros) and a pad mask."""
    T = max(p.shape[0] for p in prompts)
    batch = prompts[0].new_zeros((len(prompts), T, *prompts[0].shape[1:]))
    pad = torch.ones(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        batch[i, T - p.shape[0]:] = p
        pad[i, T - p.shape[0]:] = False
    return batch.to(device), pad.to(device)


@torch.no_grad()
def generate(
    model: KimiLinearForCausalLM,
    input_ids: Sequence[Sequence[int]] | None = None,
    inputs_embeds: Sequence[torch.Tensor] | None = None,
    params: SamplingParams = SamplingParams(),  # noqa: B008 (frozen dataclass)
    on_token: Callable[[int, int], None] | None = None,
    latent_cache_dtype: torch.dtype | None = None,
    allowed_ids: torch.Tensor | None = None,
) -> list[Generation]:
    """Generate for a batch of prompts (token id lists, or `[T_i, hidden]` embedding tensors).

    on_token(sequence_index, token_id) streams each generated token (stop tokens excluded) as soon
    as it is sampled. allowed_ids (bool `[vocab]`) restricts what may be sampled, e.g. to the ids a
    tokenizer can decode when its vocabulary is smaller than the head. Returns one Generation per
    prompt, in order.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if params.max_new_tokens is None:
        raise ValueError("params.max_new_tokens is None: resolve it from the prompt's length first")
    prompts = list(input_ids if input_ids is not None else inputs_embeds)
    if not prompts:
        raise ValueError("no prompts")
    device = model.device
    if input_ids is not None:
        tensors = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
    else:
        tensors = [torch.as_tensor(p) for p in prompts]
        bad = [i for i, p in enumerate(tensors) if p.dim() != 2 or p.shape[1] != model.cfg.hidden_size]
        if bad:
            raise ValueError(f"inputs_embeds[{bad[0]}] must be [T, {model.cfg.hidden_size}], "
                             f"got {list(tensors[bad[0]].shape)}")
    empty = [i for i, p in enumerate(tensors) if p.shape[0] == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty")
    if allowed_ids is not None and tuple(allowed_ids.shape) != (model.cfg.vocab_size,):
        raise ValueError(f"allowed_ids must be a bool mask of shape [{model.cfg.vocab_size}], "
                         f"got {list(allowed_ids.shape)}")
    blocked = None if allowed_ids is None else ~allowed_ids.to(device=device, dtype=torch.bool)
    batch, pad_mask = _left_pad(tensors, device)
    B = batch.shape[0]
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)
    cache = model.new_cache(B, latent_dtype=latent_cache_dtype)
    if input_ids is not None:
        logits = model(input_ids=batch, cache=cache, pad_mask=pad_mask, last_only=True)
    else:
        logits = model(inputs_embeds=batch, cache=cache, pad_mask=pad_mask, last_only=True)

    stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    results = [Generation([], "length") for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        if blocked is not None:
            logits = logits.masked_fill(blocked, float("-inf"))
        next_ids = sample(logits, params, gen)
        is_stop = torch.isin(next_ids, stops)
        for i, (tok, stop, finished) in enumerate(zip(next_ids.tolist(), is_stop.tolist(), done.tolist(),
                                                       strict=True)):
            if finished:
                continue
            if stop:
                results[i].finish_reason = "stop"
            else:
                results[i].tokens.append(tok)
                if on_token is not None:
                    on_token(i, tok)
        done |= is_stop
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        logits = model(input_ids=next_ids[:, None], cache=cache, last_only=True)
    return results
