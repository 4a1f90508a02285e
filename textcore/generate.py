"""Batched generation with the KimiLinear trunk: each prompt prefilled into its own cache, then one
token per step for all sequences together.

Every sequence keeps its own cache (`textcore.model.SequenceCache`), so prompts of different
lengths need no padding and each sequence gets the logits it would get alone. Prompts are token ids
or embeddings (the service splices image embeddings into `embed_tokens(ids)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from textcore.config import END_OF_MSG
from textcore.model import KimiLinearForCausalLM, TrunkCache


class SamplingError(ValueError):
    """A sampling parameter out of its range; the message names the field and the value."""

    kind = "bad_input"  # in the service's error taxonomy (service.errors.Kind)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the one place the ranges are checked (every face reports its `SamplingError`)."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = (END_OF_MSG,)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")


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
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


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
    B = len(tensors)
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)
    cache = TrunkCache([model.new_sequence(len(p) + params.max_new_tokens, latent_cache_dtype) for p in tensors])
    key = "input_ids" if input_ids is not None else "inputs_embeds"
    logits = torch.cat([model(**{key: p[None].to(device)}, cache=TrunkCache([sequence]), last_only=True)
                        for p, sequence in zip(tensors, cache.sequences, strict=True)])

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
