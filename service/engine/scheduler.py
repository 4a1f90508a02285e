"""The trunk's scheduler: continuous batching, chunked prefill and admission by KV-cache budget.

One thread owns the trunk and runs engine steps. Each step:

1. drops the sequences whose caller left (their caches are freed at once);
2. admits waiting generations in arrival order while each one's worst-case cache (n sequences of
   prompt + max_new_tokens tokens, `SequenceCache.worst_case_bytes`) fits the KV budget and the
   batch stays within `max_num_seqs`; the first that does not fit waits, and so do those behind it;
3. runs one forward (`textcore.generate.decode_step`): a token of every running sequence, and prefill
   chunks of the admitted prompts, oldest first, in the rest of the step's `max_num_batched_tokens`,
   so a long prompt never stalls the running streams for its whole prefill. While sequences decode,
   a chunk's tokens are weighed by their work (`prefill_chunk`): a token also pays for the earlier
   keys its attention covers, so a step that carries a chunk late in a long prompt stays about as
   long as one early in it, instead of growing with the prefix. All of the step's
   tokens go through the per-token layers together (the routed experts see them in one MoE call).
   The running sequences sample their next token; a prompt whose last chunk is in is forked into
   its n sequences, which sample their first token and run from the next step.

Each sequence has its own cache, sampler (seeded `seed + index`), output parser and stop strings,
so batching changes no sequence's tokens. What a sequence produces goes back to its caller as
`Choice` items through the generation's `emit`, called on this thread. A generation that could
never run here (n over `max_num_seqs`, a worst case over the whole budget, ids outside the
vocabulary) was refused when it was prepared (`service.engine.inputs`), before any pixel was
decoded; `submit` only asserts it. A step that fails ends the generations in it, not those waiting.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from service.cpus import usable_memory
from service.engine.inputs import Prompt
from service.errors import BadRequest, TooLarge, Unavailable
from service.metrics import Metrics
from textcore.generate import (
    Sample,
    Sampler,
    SamplingError,
    SamplingParams,
    TokenSpace,
    decode_step,
    sample_batch,
)
from textcore.model import KimiLinearForCausalLM, SequenceCache
from textcore.parser import Event, output_parser
from textcore.splice import splice_rows
from textcore.stops import StopStrings
from textcore.tokenizer import END_OF_MSG_ID, Tokenizer

log = logging.getLogger(__name__)

KV_MEMORY_FRACTION = 0.25  # default KV budget: this share of the trunk device's memory (CUDA: free after loading)


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV budget when none is configured: a share of the device's free memory (CUDA) or of the
    memory this process may use (CPU: physical, or its cgroup's limit when lower, `service.cpus`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * KV_MEMORY_FRACTION)
    return int(usable_memory() * KV_MEMORY_FRACTION)


def chunk_cost(tokens: int, past: int, keys_per_token: float | None) -> float:
    """The work of a prompt chunk of `tokens` tokens after `past` prefilled ones, in tokens: each
    one, plus (with `keys_per_token`) the `past + i` earlier keys chunk token i attends to, at
    `keys_per_token` keys a token (`KimiLinearForCausalLM.keys_per_token`)."""
    if keys_per_token is None:
        return float(tokens)
    return tokens + (tokens * past + tokens * (tokens - 1) / 2) / keys_per_token


def prefill_chunk(budget: float, past: int, remaining: int, keys_per_token: float | None) -> int:
    """The most of a prompt's `remaining` tokens (after `past` prefilled) whose `chunk_cost` fits in
    `budget`: the root of the cost's quadratic, then checked against it."""
    if keys_per_token is None:
        take = int(budget)
    else:
        a, b = 1 / (2 * keys_per_token), 1 + (past - 0.5) / keys_per_token
        take = int((math.sqrt(b * b + 4 * a * max(budget, 0.0)) - b) / (2 * a))
    take = max(0, min(remaining, take))
    while take and chunk_cost(take, past, keys_per_token) > budget:  # the float root's rounding
        take -= 1
    return take


@dataclass(frozen=True)
class GenerationResult:
    """The last item of each choice of `Engine.generate`."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int  # after expansion
    image_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None  # what stopped it: a stop_token_ids id, a stop string (vLLM's)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Logprobs:
    """One sampled token's log-probability and the most likely tokens at its position, by id. Their
    text is read by the face that reports them (`text`), not on the trunk's thread."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]
    token_bytes: Callable[[int], bytes]  # a token's exact bytes (the tokenizer's)

    def text(self, entry: TokenLogprob) -> tuple[str, bytes]:
        """`entry`'s text (a character cut in half by the tokenizer shows as U+FFFD) and its exact bytes."""
        data = self.token_bytes(entry.token_id)
        return data.decode("utf-8", errors="replace"), data


class Choice(NamedTuple):
    """An item of `Engine.generate`: which of the request's n replies (0-based) and what: a parser
    event, a token's `Logprobs` (before the events of its text), or the reply's `GenerationResult`."""

    index: int
    item: Event | Logprobs | GenerationResult


# What a job's emit receives: its choices' items, then None (every choice ended) or the exception
# that ended the job.
Emit = Callable[[Choice | BaseException | None], None]


@dataclass
class Generation:
    """One generation request: `params.n` sequences continuing `prompt`, its media spans filled
    with `rows` (one tensor per item). The caller sets `cancelled` when it leaves; the scheduler
    then drops the generation at its next step."""

    prompt: Prompt
    rows: list[torch.Tensor]
    params: SamplingParams  # max_new_tokens resolved (`Preparer.prepare`)
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Called on the scheduler's thread as each token is sampled: (choice, whether it is an output
    # token, as a stop token is not); the engine times and counts the tokens with it.
    sampled: Callable[[int, bool], None] = lambda index, output: None
    # set by the scheduler
    sequence_bytes: int = 0  # one sequence's worst-case cache
    open: int = 0  # sequences still running
    ended: bool = False  # the caller has heard the end (None or an exception)

    def end(self, exc: BaseException | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.emit(exc)


def trunk_embeds(model: KimiLinearForCausalLM, prompt: Prompt, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The trunk's input rows `[T, hidden]`: token embeddings with each media span replaced by its rows."""
    ids = torch.tensor(prompt.ids, dtype=torch.long, device=model.device)
    return splice_rows(model.embed_tokens(ids), prompt.spans, rows)


class _Prefill:
    """An admitted job whose prompt is going into its (first) cache, chunk by chunk."""

    def __init__(self, job: Generation, model: KimiLinearForCausalLM, latent_dtype: torch.dtype | None) -> None:
        self.job = job
        self.embeds = trunk_embeds(model, job.prompt, job.rows)
        self.cache = model.new_sequence(len(job.prompt.ids) + job.params.max_new_tokens, latent_dtype)
        self.done = 0


class _Sequence:
    """One running sequence: its cache, sampler, parser and stop strings."""

    def __init__(self, job: Generation, index: int, cache: SequenceCache, sampler: Sampler,
                 tokenizer: Tokenizer) -> None:
        self.job = job
        self.index = index
        self.cache: SequenceCache | None = cache
        self.sampler = sampler
        params = job.params
        self.parser = output_parser(tokenizer, turn=job.prompt.turn, thinking=job.prompt.thinking,
                                    skip_special_tokens=params.skip_special_tokens,
                                    spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stops = StopStrings(params.stop, include=params.include_stop_str_in_output)
        # what a Logprobs item reads its tokens' text with (holding the tokenizer, not this sequence)
        self.token_bytes: Callable[[int], bytes] = lambda token_id: tokenizer.decode_bytes([token_id])
        self.last = -1
        self.finished = False

    def accept(self, sample: Sample) -> None:
        """Take the sampled token: report it (logprobs, then the text it completes) and finish the
        sequence at a stop token, a stop string or its length."""
        reason = self.sampler.take(sample.token_id)
        self.job.sampled(self.index, reason != "stop")
        stop_reason: int | str | None = None
        if reason == "stop" and sample.token_id != END_OF_MSG_ID:
            stop_reason = sample.token_id
        if reason == "stop":  # a stop token is not part of the reply; <|end_of_msg|> ends the parser's turn
            events = self.parser.feed([END_OF_MSG_ID]) if sample.token_id == END_OF_MSG_ID else []
        else:
            self.last = sample.token_id
            if sample.logprobs is not None:
                raw = sample.logprobs
                self._emit(Logprobs(TokenLogprob(raw.token_id, raw.logprob), tuple(map(TokenLogprob._make, raw.top)),
                                    self.token_bytes))
            events = self.parser.feed([sample.token_id])
        released = self.stops.feed(events, search=len(self.sampler.tokens) > self.job.params.min_tokens)
        if self.stops.matched is not None:
            reason, stop_reason = "stop", self.stops.matched
        elif reason is not None:
            released += self.stops.feed(self.parser.close())
            released += self.stops.flush()
        for event in released:
            self._emit(event)
        if reason is not None:
            prompt = self.job.prompt
            self._emit(GenerationResult(reason, len(prompt.ids), prompt.media_tokens, len(self.sampler.tokens),
                                        stop_reason))
            self.finished = True

    def _emit(self, item: Event | Logprobs | GenerationResult) -> None:
        self.job.emit(Choice(self.index, item))


class Scheduler:
    """The thread that owns the trunk (see the module docstring). `submit` and `close` may be called
    from any thread; everything else runs on the scheduler's own."""

    def __init__(self, model: KimiLinearForCausalLM, tokenizer: Tokenizer, *, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_cache_bytes: int, allowed_ids: torch.Tensor | None = None,
                 latent_dtype: torch.dtype | None = None, metrics: Metrics | None = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs; got {max_num_seqs} "
                             f"and {max_num_batched_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.keys_per_token = model.keys_per_token()  # a chunk token's attention, weighed while others decode
        self.kv_cache_bytes = kv_cache_bytes
        self.latent_dtype = latent_dtype
        self.metrics = metrics
        self._space = TokenSpace(model.cfg.vocab_size, allowed_ids, model.device)  # what may be sampled
        self._wake = threading.Condition()
        self._waiting: deque[Generation] = deque()
        self._prefilling: list[_Prefill] = []
        self._running: list[_Sequence] = []
        self.reserved_bytes = 0  # worst-case caches of the admitted jobs
        self.last_batch = 0  # sequences in the last decode step
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kimi-vision-trunk", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def sequence_bytes(self, tokens: int) -> int:
        """What one sequence of `tokens` tokens holds (its cache, sized once for them)."""
        return SequenceCache.worst_case_bytes(self.model.cfg, tokens, self.model.dtype, self.latent_dtype)

    def worst_case_bytes(self, prompt_tokens: int, params: SamplingParams) -> int:
        """What a job's n sequences may hold at most."""
        return params.n * self.sequence_bytes(prompt_tokens + params.max_new_tokens)

    def check_sequences(self, params: SamplingParams) -> None:
        """The n sequences of a request decode together: n within `max_num_seqs` (checked once, by
        `Preparer.check`, before anything is read)."""
        if params.n > self.max_num_seqs:
            raise BadRequest(f"n {params.n} is above this server's --max-num-seqs {self.max_num_seqs} "
                             "(the n sequences of a request decode together)")

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a generation that could never be admitted or started, once its prompt is counted
        (`Preparer.prepare`): a worst-case cache over the whole KV budget (`TooLarge`), token ids
        outside the vocabulary or only outside what can be sampled (`SamplingError`).
        `params.max_new_tokens` is resolved."""
        assert params.max_new_tokens is not None, "resolve max_new_tokens from the prompt's length first"
        need = self.worst_case_bytes(prompt_tokens, params)
        if need > self.kv_cache_bytes:
            raise TooLarge(f"this request's worst-case KV cache ({params.n} x ({prompt_tokens:,} prompt + "
                           f"{params.max_new_tokens:,} new tokens)) is {need:,} bytes, over the server's KV cache "
                           f"budget of {self.kv_cache_bytes:,} bytes (--kv-cache-memory-gb); send a shorter "
                           "prompt or ask for fewer tokens")
        params.check_vocab(self.model.cfg.vocab_size)
        if params.allowed_token_ids and not self._space.columns(params.allowed_token_ids):
            raise SamplingError("allowed_token_ids names no token this model's tokenizer can write")

    def submit(self, job: Generation) -> None:
        """Queue a generation `check`ed when it was prepared (nothing is checked again here)."""
        assert job.params.max_new_tokens is not None and job.params.n <= self.max_num_seqs, "submit a prepared request"
        job.sequence_bytes = self.sequence_bytes(len(job.prompt.ids) + job.params.max_new_tokens)
        with self._wake:
            if self._closed:
                raise Unavailable("the scheduler is closed")
            self._waiting.append(job)
            self._wake.notify()

    @property
    def idle(self) -> bool:
        """No generation waiting, prefilling or running."""
        return not (self._waiting or self._prefilling or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def load(self) -> tuple[int, int]:
        """(sequences admitted: decoding or having their prompt prefilled, sequences waiting to be
        admitted), a generation's n counting as n: what vLLM counts as running and waiting requests."""
        with self._wake:
            waiting = sum(job.params.n for job in self._waiting)
        return len(self._running) + sum(p.job.params.n for p in self._prefilling), waiting

    def close(self) -> None:
        """Stop after the current step; generations still open (queued too) end `Unavailable`."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the scheduler's thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and self.idle:
                    self._wake.wait()
                if self._closed:
                    break
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its jobs, not the server
                log.exception("trunk step failed")
                self._end_admitted(exc)
        closed = Unavailable("the engine was closed while the generation ran")  # retryable: elsewhere or later
        with self._wake:  # submit refuses from now on: nothing joins after this
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            job.end(closed)
        self._end_admitted(closed)

    def _end_admitted(self, exc: BaseException) -> None:
        """End the admitted jobs (prefilling or running) with `exc` and drop them; the waiting
        ones were not in the step and stay queued."""
        jobs = {id(j): j for j in [*(p.job for p in self._prefilling), *(s.job for s in self._running)]}
        for job in jobs.values():
            job.end(exc)
        self._prefilling, self._running, self.reserved_bytes = [], [], 0
        self._report()

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        batch = self._running
        budget: float = self.max_num_batched_tokens - len(batch)
        keys_per_token = self.keys_per_token if batch else None  # alone, a chunk is bounded by its tokens
        chunks: list[tuple[_Prefill, int]] = []
        for prefill in self._prefilling:
            remaining = len(prefill.job.prompt.ids) - prefill.done
            take = prefill_chunk(budget, prefill.done, remaining, keys_per_token)
            if not chunks:
                take = max(take, 1)  # the oldest prompt always moves on
            if not take:
                break
            chunks.append((prefill, take))
            budget -= chunk_cost(take, prefill.done, keys_per_token)
        self.last_batch = len(batch)
        if batch or chunks:
            self._forward(batch, chunks)
        self._report()

    def _forward(self, batch: list[_Sequence], chunks: list[tuple[_Prefill, int]]) -> None:
        """One forward of the step: a token for every running sequence and the prompt chunks; the
        running ones sample their next token, a prompt whose last chunk this was starts."""
        caches = [s.cache for s in batch] + [prefill.cache for prefill, _ in chunks]
        try:
            logits = decode_step(self.model, caches, [s.last for s in batch], self._space,
                                 [prefill.embeds[prefill.done:prefill.done + take] for prefill, take in chunks])
            samples = sample_batch(logits[:len(batch)], [s.sampler for s in batch])
        except Exception as exc:  # noqa: BLE001 - the step's jobs fail; the scheduler goes on
            log.exception("trunk step failed")
            for sequence in batch:
                sequence.job.end(exc)
                self._finish(sequence)
            for prefill, _ in chunks:
                self._release(prefill)
                prefill.job.end(exc)
            self._running = [s for s in self._running if not s.finished]
            return
        for sequence, sample in zip(batch, samples, strict=True):
            sequence.accept(sample)
            if sequence.finished:
                self._finish(sequence)
        self._running = [s for s in batch if not s.finished]
        for (prefill, take), row in zip(chunks, logits[len(batch):], strict=True):
            prefill.done += take
            if prefill.done == len(prefill.job.prompt.ids):
                self._start(prefill, row[None])
                self._prefilling.remove(prefill)  # after: a start that fails leaves its job among the admitted

    def _drop_cancelled(self) -> None:
        for sequence in self._running:
            if sequence.job.cancelled.is_set():
                self._finish(sequence)
        self._running = [s for s in self._running if not s.finished]
        for prefill in [p for p in self._prefilling if p.job.cancelled.is_set()]:
            self._release(prefill)
        with self._wake:
            self._waiting = deque(job for job in self._waiting if not job.cancelled.is_set())

    def _admit(self) -> None:
        while True:
            with self._wake:
                if not self._waiting:
                    return
                job = self._waiting[0]
                need = job.params.n * job.sequence_bytes
                seqs = len(self._running) + sum(p.job.params.n for p in self._prefilling) + job.params.n
                if seqs > self.max_num_seqs or self.reserved_bytes + need > self.kv_cache_bytes:
                    return
                self._waiting.popleft()
            self.reserved_bytes += need
            try:
                self._prefilling.append(_Prefill(job, self.model, self.latent_dtype))
            except Exception as exc:  # noqa: BLE001 - this job's input (e.g. an id outside the vocabulary)
                self.reserved_bytes -= need
                job.end(exc)

    def _release(self, prefill: _Prefill) -> None:
        """A prompt leaves before it starts: its cache is dropped and its n sequences' reservation returned."""
        self._prefilling.remove(prefill)
        self.reserved_bytes -= prefill.job.params.n * prefill.job.sequence_bytes

    def _start(self, prefill: _Prefill, logits: torch.Tensor) -> None:
        """The prompt is in: fork its cache into the job's n sequences, each samples its first token."""
        job, params = prefill.job, prefill.job.params
        caches = [prefill.cache] + [prefill.cache.fork() for _ in range(params.n - 1)]
        samplers = [Sampler(params, self._space, self.model.device, prompt_ids=job.prompt.ids, seed=params.seed_of(i))
                    for i in range(params.n)]
        sequences = [_Sequence(job, i, cache, sampler, self.tokenizer)
                     for i, (cache, sampler) in enumerate(zip(caches, samplers, strict=True))]
        job.open = params.n
        first = sample_batch(logits.expand(params.n, -1), samplers)
        for sequence, sample in zip(sequences, first, strict=True):
            sequence.accept(sample)
            if sequence.finished:
                self._finish(sequence)
            else:
                self._running.append(sequence)

    def _finish(self, sequence: _Sequence) -> None:
        """A sequence leaves: its cache is freed and its share of the budget returned; the job's
        caller hears the end once its last sequence has left."""
        sequence.finished = True
        sequence.cache = None
        self.reserved_bytes -= sequence.job.sequence_bytes
        job = sequence.job
        job.open -= 1
        if job.open == 0 and not job.cancelled.is_set():
            job.end()

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.running_sequences.set(len(self._running))
            self.metrics.waiting_generations.set(len(self._waiting) + len(self._prefilling))
            self.metrics.kv_cache_reserved_bytes.set(self.reserved_bytes)
