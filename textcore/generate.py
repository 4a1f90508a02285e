"""Generation with the KimiLinear trunk: sampling parameters, per-sequence logits processing and
sampling, and batched decoding over per-sequence caches.

Every sequence keeps its own cache (`textcore.model.SequenceCache`) and its own `Sampler` (its
parameters, its generator, what it has generated), so sequences of any lengths decode together in
one forward per step and each gets the tokens it would get alone, a seeded one included. The
service's scheduler (`service.engine.scheduler`) and `generate` below are built from the same parts:
`TokenSpace`, `Sampler`, `sample_batch` and `decode_step` (whose forward also takes the prompt
chunks of a scheduler step).

From a sequence's logits to its next token, in vLLM's order: logits only for the ids that can be
sampled (`TokenSpace`), the raw log-probabilities taken from them (`logprobs`);
`allowed_token_ids` (every other id masked); `min_tokens` (the stop tokens masked until that many
tokens exist); `logit_bias` (added); the penalties (repetition over prompt and output tokens, then
frequency and presence over output tokens); then greedy argmax, or temperature, min-p, top-k,
top-p and a draw from the sequence's own generator.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from textcore.config import END_OF_MSG
from textcore.model import KimiLinearForCausalLM, SequenceCache, TrunkCache

# Below this a temperature is greedy, as in vLLM (its _SAMPLING_EPS): dividing the logits by it
# would overflow float32 and give NaN probabilities.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range (and vLLM's): above it float32 logits / T lose all contrast, then overflow
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI, vLLM)
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs range


class SamplingError(ValueError):
    """A sampling parameter out of its range; the message names the field and the value."""

    kind = "bad_input"  # in the service's error taxonomy (service.errors.Kind)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the one place the ranges are checked (every face reports its `SamplingError`).

    Generation ends at <|end_of_msg|> (unless `ignore_eos`), at any of `stop_token_ids`, or after
    `max_new_tokens`; `stop` strings end it in the text (`textcore.stops`). `n` sequences continue
    the prompt, the i-th seeded `seed + i`. `max_new_tokens` None: as many as the model length
    leaves after the prompt (the caller, who knows the prompt, resolves it before generating)."""

    max_new_tokens: int | None = 256
    temperature: float = 0.0  # 0 = greedy (so is anything below GREEDY_BELOW)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides <|end_of_msg|>
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    min_p: float = 0.0  # 0 = no min-p cut
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text
    spaces_between_special_tokens: bool = True  # a special token written as text is set apart by spaces
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise SamplingError("allowed_token_ids must not be empty (leave it out to allow every token)")
        for name in ("temperature", "top_p", "min_p"):
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
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.n < 1:
            raise SamplingError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise SamplingError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise SamplingError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.min_tokens < 0 or (self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens):
            raise SamplingError(f"min_tokens must be from 0 to max_new_tokens ({self.max_new_tokens}), "
                                f"got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs needs logprobs to be true")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop must hold non-empty strings, got {list(self.stop)}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for token_id in getattr(self, name) or ():
                if token_id < 0:
                    raise SamplingError(f"{name} must hold token ids (>= 0), got {token_id}")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise SamplingError(f"logit_bias keys must be token ids (>= 0), got {token_id}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise SamplingError(f"logit_bias[{token_id}] must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                                    f"got {bias}")

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids named (stop_token_ids, logit_bias, allowed_token_ids) must be in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            outside = sorted(i for i in ids if i >= vocab_size)
            if outside:
                raise SamplingError(f"{name} names token {outside[0]}, outside the vocabulary [0, {vocab_size})")

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def seed_of(self, index: int) -> int | None:
        """The seed of the `index`-th of the n sequences (vLLM's `seed + index`, within uint64)."""
        return None if self.seed is None else (self.seed + index) % 2**64


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the `top_logprobs` most likely tokens (most likely
    first), from the model's distribution before any sampling parameter (vLLM's raw logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprobs: TokenLogprobs | None


class TokenSpace:
    """The token ids sampling chooses among, which are the columns of the logits it is given: every
    id of the head, or only those a tokenizer can decode (`allowed`, when its vocabulary is smaller
    than the head: the tiny checkpoint's few hundred of 163,840). Logits are computed for these ids
    only (`KimiLinearForCausalLM.step`'s `head_ids`), so an id outside is never sampled nor listed."""

    def __init__(self, vocab_size: int, allowed: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        if allowed is not None and tuple(allowed.shape) != (vocab_size,):
            raise ValueError(f"allowed_ids must be a bool mask of shape [{vocab_size}], got {list(allowed.shape)}")
        self.vocab_size = vocab_size
        everything = allowed is None or bool(allowed.all())
        self.ids = None if everything else allowed.to(torch.bool).nonzero()[:, 0].to(device)  # column -> id
        self._ids = None if self.ids is None else self.ids.tolist()
        self._column = None if self._ids is None else {token_id: c for c, token_id in enumerate(self._ids)}
        self.size = vocab_size if self._ids is None else len(self._ids)

    def columns(self, ids: Sequence[int]) -> list[int]:
        """The columns of those of `ids` that are in the space."""
        if self._column is None:
            return list(ids)
        return [self._column[i] for i in ids if i in self._column]

    def token(self, column: int) -> int:
        return column if self._ids is None else self._ids[column]


class Sampler:
    """One sequence's logits processing and draws: its parameters, its own generator (seeded, or
    from the OS), its output tokens so far (`tokens`, for the penalties and `min_tokens`). It works
    on the columns of a `TokenSpace`."""

    def __init__(self, params: SamplingParams, space: TokenSpace, device: torch.device | str = "cpu", *,
                 prompt_ids: Sequence[int] = (), seed: int | None = None):
        if params.max_new_tokens is None:
            raise ValueError("params.max_new_tokens is None: resolve it from the prompt's length first")
        params.check_vocab(space.vocab_size)
        self.params = params
        self.space = space
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed if seed is not None else secrets.randbits(63))
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else {END_OF_MSG})
        # min_tokens holds back every stop token, <|end_of_msg|> too (as vLLM does even with ignore_eos)
        self._held_back = self._columns(sorted({*params.stop_token_ids, END_OF_MSG}))
        self.tokens: list[int] = []
        self._counts = torch.zeros(space.size, device=self.device) if params.penalised else None
        self._in_prompt = None
        if params.repetition_penalty != 1:
            self._in_prompt = torch.zeros(space.size, dtype=torch.bool, device=self.device)
            self._in_prompt[self._columns(prompt_ids)] = True
        self._disallowed = None
        if params.allowed_token_ids is not None:
            self._disallowed = torch.ones(space.size, dtype=torch.bool, device=self.device)
            self._disallowed[self._columns(params.allowed_token_ids)] = False
        self._bias = None
        biased = [(i, b) for i, b in sorted(params.logit_bias.items()) if space.columns([i])]
        if biased:  # a bias on an id outside the space changes nothing: it is never sampled
            self._bias = (self._columns([i for i, _ in biased]),
                          torch.tensor([b for _, b in biased], device=self.device))

    def _columns(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(self.space.columns(ids), dtype=torch.long, device=self.device)

    @property
    def takes_argmax(self) -> bool:
        """This step's token is the argmax of the logits as they come (greedy, nothing to process)."""
        p = self.params
        return p.temperature == 0 and not (len(self.tokens) < p.min_tokens or p.logit_bias or p.penalised
                                           or p.allowed_token_ids)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[space.size]` fp32 -> what the draw sees (`logits` itself is never written: the
        batch's raw logprobs are read from it)."""
        p = self.params
        held = len(self.tokens) < p.min_tokens
        out = logits.clone() if held or self._bias is not None else logits  # the two edits in place
        if self._disallowed is not None:
            out = out.masked_fill(self._disallowed, float("-inf"))
        if held:
            out[self._held_back] = float("-inf")
        if self._bias is not None:
            out.index_add_(0, *self._bias)
        if self._counts is not None:
            if self._in_prompt is not None:
                seen = self._in_prompt | (self._counts > 0)
                penalty = torch.where(seen, p.repetition_penalty, 1.0)
                out = torch.where(out > 0, out / penalty, out * penalty)
            out = out - (p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0))
        return out

    def draw(self, logits: torch.Tensor) -> int:
        """A column from processed `logits`: argmax at temperature 0, else min-p, top-k, then top-p
        (vLLM's order), then a draw from this sequence's generator."""
        p = self.params
        if p.temperature == 0:
            return int(logits.argmax())
        # (logits - max) / t stays finite for any t > 0; -inf / inf is the only NaN, and it is -inf
        scaled = ((logits - logits.max()) / p.temperature).nan_to_num(nan=float("-inf"))
        if p.min_p:
            # the max of `scaled` is 0, so a token's probability over the top one's is exp(scaled)
            scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.shape[-1])).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1:
            ordered, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # drop a token when the tokens ranked above it already reach top_p (the first always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            drop[0] = False  # also when top_p rounds to 0 in float32 (5e-324)
            scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=self.generator))

    def take(self, token_id: int) -> str | None:
        """Record a sampled token; the finish reason if the sequence ends with it: "stop" (a stop
        token: not an output token) or "length" (the max_new_tokens-th output token)."""
        if token_id in self.stop_ids:
            return "stop"
        self.tokens.append(token_id)
        if self._counts is not None:
            self._counts[self.space.columns([token_id])] += 1
        return "length" if len(self.tokens) >= self.params.max_new_tokens else None


def sample_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[Sample]:
    """One token for each row of `logits` `[B, space.size]` (the samplers' `TokenSpace`), row b by
    `samplers[b]`. The rows that take the plain argmax share one, those that report logprobs one
    log-softmax; every other row is processed and drawn on its own."""
    logits = logits.float()
    columns: list[int | None] = [None] * len(samplers)
    plain = [b for b, s in enumerate(samplers) if s.takes_argmax]
    if plain:
        for b, column in zip(plain, logits[plain].argmax(-1).tolist(), strict=True):
            columns[b] = column
    for b, sampler in enumerate(samplers):
        if columns[b] is None:
            columns[b] = sampler.draw(sampler.process(logits[b]))
    tokens = [sampler.space.token(c) for sampler, c in zip(samplers, columns, strict=True)]
    reported: dict[int, TokenLogprobs] = {}
    wanted = [b for b, s in enumerate(samplers) if s.params.logprobs]
    if wanted:
        logprobs = torch.log_softmax(logits[wanted], dim=-1)
        picked = torch.tensor([[columns[b]] for b in wanted], device=logits.device)
        chosen = logprobs.gather(1, picked)[:, 0].tolist()
        k = min(max(samplers[b].params.top_logprobs for b in wanted), logits.shape[-1])  # fewer ids: fewer listed
        top = torch.topk(logprobs, k) if k else None
        for i, b in enumerate(wanted):
            count, space = samplers[b].params.top_logprobs, samplers[b].space
            pairs = () if not count else tuple((space.token(c), lp) for c, lp in zip(
                top.indices[i, :count].tolist(), top.values[i, :count].tolist(), strict=True))
            reported[b] = TokenLogprobs(tokens[b], chosen[i], pairs)
    return [Sample(token_id, reported.get(b)) for b, token_id in enumerate(tokens)]


def decode_step(model: KimiLinearForCausalLM, caches: Sequence[SequenceCache], tokens: Sequence[int],
                space: TokenSpace, prompt_chunks: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """One batched forward: `tokens[b]` continues `caches[b]` (all the ids in one host-to-device
    copy), then each of `prompt_chunks` (a prompt's next `[T, hidden]` rows) continues the next
    cache; the next-token logits over `space` at each one's last token, `[len(caches), space.size]`."""
    ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
    return model.step([*ids[:, None], *prompt_chunks], TrunkCache(list(caches)), head_ids=space.ids)


@dataclass
class Generation:
    tokens: list[int]  # generated ids, without the stop token
    finish_reason: str  # "stop" (a stop token came) or "length" (max_new_tokens reached)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, with params.logprobs


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
    """Generate for a batch of prompts (token id lists, or `[T_i, hidden]` embedding tensors), each
    prefilled alone, then decoded together (seeded prompts each from `params.seed`: the same tokens
    as alone). Stop strings and `n` are the caller's (they need the text, and several sequences).

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
    if params.max_new_tokens is None:
        raise ValueError("params.max_new_tokens is None: resolve it from the prompt's length first")
    space = TokenSpace(model.cfg.vocab_size, allowed_ids, device)
    caches, samplers = [], []
    pool = model.new_pool(latent_dtype=latent_cache_dtype)
    for p in tensors:
        caches.append(model.new_sequence(pool))
        samplers.append(Sampler(params, space, device, prompt_ids=p.tolist() if input_ids is not None else (),
                                seed=params.seed))
    step_logits = model.step([p.to(device) for p in tensors], TrunkCache(caches), head_ids=space.ids)
    results = [Generation([], "length") for _ in tensors]
    active = list(range(len(tensors)))
    while active:
        samples = sample_batch(step_logits, [samplers[i] for i in active])
        going = []
        for i, sample in zip(active, samples, strict=True):
            reason = samplers[i].take(sample.token_id)
            if reason != "stop":
                results[i].tokens.append(sample.token_id)
                if sample.logprobs is not None:
                    results[i].logprobs.append(sample.logprobs)
                if on_token is not None:
                    on_token(i, sample.token_id)
            if reason is None:
                going.append(i)
            else:
                results[i].finish_reason = reason
        active = going
        if active:
            step_logits = decode_step(model, [caches[i] for i in active], [results[i].tokens[-1] for i in active],
                                      space)
    return results
