"""The trunk's scheduler: continuous batching, chunked prefill, admission by KV blocks, preemption.

One thread owns the trunk and runs engine steps. Each step:

1. drops the sequences whose caller left or whose reply a stop string ended (`service.engine.output`);
   their blocks go back to the pool at once;
2. gives each running sequence the block its next token needs (`KVCacheManager.grow`); when the
   pool is dry, the most recently admitted sequence (or prompt being prefilled) is preempted: its
   blocks are freed and it goes back to the front of the queue with what it has generated, to be
   prefilled again (prompt and tokens) when blocks are free. Its sampler (penalties, min_tokens,
   its seeded generator) is kept, so its reply is the one it would have had;
3. admits from the front of the queue while the batch stays within `max_num_seqs` and the pool has
   the blocks of the prompt (n of them for n sequences; a preempted one's prompt and tokens) plus a
   watermark; the first that does not fit waits, and so do those behind it;
4. runs one forward (`textcore.generate.decode_step`): a token of every running sequence, and prefill
   chunks of the admitted prompts, oldest first, in the rest of the step's `max_num_batched_tokens`,
   so a long prompt never stalls the running streams for its whole prefill. While sequences decode,
   a chunk's tokens are weighed by their work (`prefill_chunk`): a token also pays for the earlier
   keys its attention covers, so a step that carries a chunk late in a long prompt stays about as
   long as one early in it, instead of growing with the prefix. All of the step's
   tokens go through the per-token layers together (the routed experts see them in one MoE call).
   The running sequences sample their next token; a prompt whose last chunk is in is copied into
   its n sequences, which sample their first token and run from the next step.

Each sequence has its own cache and sampler (seeded `seed + index`), so batching and preemption
change no sequence's tokens. This thread only samples and decides the finishes that need no text
(a stop token, the length); the sampled ids go to the output processor (`service.engine.output`),
which turns them into each reply's `Choice` items and calls the generation's `emit`. A generation
that could never run here (n over `max_num_seqs`, a prompt or sequence the pool cannot hold, ids
outside the vocabulary) was refused when it was prepared (`service.engine.inputs`), before any
pixel was decoded; `submit` only asserts it. A step that fails ends the generations in it, not
those waiting.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from service.cpus import usable_memory
from service.engine.inputs import Prompt
from service.engine.kv import KVCacheManager
from service.engine.output import Choice, GenerationResult, Logprobs, OutputProcessor, Reply, TokenLogprob
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
from textcore.splice import splice_rows
from textcore.tokenizer import Tokenizer

__all__ = ["Choice", "Generation", "GenerationResult", "Logprobs", "Scheduler", "TokenLogprob", "chunk_cost",
           "default_kv_cache_bytes", "prefill_chunk"]

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
    # set by the scheduler and the output processor
    open: int = 0  # replies not yet finished (the output processor's count)
    dropped: bool = False  # the job failed: the trunk drops its sequences at its next step
    ended: bool = False  # the caller has heard the end (None or an exception)

    def end(self, exc: BaseException | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.emit(exc)

    @property
    def gone(self) -> bool:
        """Nothing more of this job is to run: its caller left or it failed."""
        return self.dropped or self.cancelled.is_set()


def trunk_embeds(model: KimiLinearForCausalLM, prompt: Prompt, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The trunk's input rows `[T, hidden]`: token embeddings with each media span replaced by its rows."""
    ids = torch.tensor(prompt.ids, dtype=torch.long, device=model.device)
    return splice_rows(model.embed_tokens(ids), prompt.spans, rows)


class _Sequence:
    """One running sequence: its cache (None while preempted), sampler and output side."""

    def __init__(self, job: Generation, index: int, cache: SequenceCache, sampler: Sampler, reply: Reply) -> None:
        self.job = job
        self.index = index
        self.cache: SequenceCache | None = cache
        self.sampler = sampler
        self.reply = reply
        self.admitted = 0  # the admission it runs under (`Scheduler._admissions`)
        self.last = -1

    @property
    def gone(self) -> bool:
        return self.job.gone or self.reply.stopped

    def cached_tokens(self) -> int:
        """What its cache holds before the next step: the prompt and every output token but the last."""
        return len(self.job.prompt.ids) + len(self.sampler.tokens) - 1


class _Prefill:
    """An admitted prompt going into its cache, chunk by chunk: a job's (its n sequences' caches,
    the first filled, copied into the others at the end), or a preempted sequence's prompt and
    tokens (`resumed`: it decodes on from where it was)."""

    def __init__(self, job: Generation, embeds: torch.Tensor, caches: list[SequenceCache], admitted: int,
                 resumed: _Sequence | None = None) -> None:
        self.job = job
        self.embeds = embeds
        self.caches = caches
        self.admitted = admitted
        self.resumed = resumed
        self.done = 0

    @property
    def total(self) -> int:
        return self.embeds.shape[0]

    @property
    def sequences(self) -> int:
        return len(self.caches)


class Scheduler:
    """The thread that owns the trunk (see the module docstring). `submit` and `close` may be called
    from any thread; everything else runs on the scheduler's own. `output_thread=False` runs the
    output processing on this thread too (what `bench.serving step` compares against)."""

    def __init__(self, model: KimiLinearForCausalLM, tokenizer: Tokenizer, *, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_cache_bytes: int, allowed_ids: torch.Tensor | None = None,
                 latent_dtype: torch.dtype | None = None, metrics: Metrics | None = None,
                 output_thread: bool = True) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs; got {max_num_seqs} "
                             f"and {max_num_batched_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.keys_per_token = model.keys_per_token()  # a chunk token's attention, weighed while others decode
        self.kv = KVCacheManager(model, kv_cache_bytes, max_num_seqs, latent_dtype)
        self.metrics = metrics
        self._space = TokenSpace(model.cfg.vocab_size, allowed_ids, model.device)  # what may be sampled
        self._output = OutputProcessor(threaded=output_thread)
        self._wake = threading.Condition()
        self._waiting: deque[Generation | _Sequence] = deque()  # a preempted sequence waits at the front
        self._prefilling: list[_Prefill] = []
        self._running: list[_Sequence] = []
        self._admissions = itertools.count(1)
        self.preemptions = 0
        self.last_batch = 0  # sequences in the last decode step
        self._closed = False
        if metrics is not None:
            metrics.kv_cache_blocks_total.set(self.kv.total)
        self._thread = threading.Thread(target=self._loop, name="kimi-vision-trunk", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def check_sequences(self, params: SamplingParams) -> None:
        """The n sequences of a request decode together: n within `max_num_seqs` (checked once, by
        `Preparer.check`, before anything is read)."""
        if params.n > self.max_num_seqs:
            raise BadRequest(f"n {params.n} is above this server's --max-num-seqs {self.max_num_seqs} "
                             "(the n sequences of a request decode together)")

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a generation that could never be admitted or finished, once its prompt is counted
        (`Preparer.prepare`): its n prompts, or one of its sequences at its full length (prompt +
        max_new_tokens), over the whole KV pool (`TooLarge`); token ids outside the vocabulary
        or only outside what can be sampled (`SamplingError`). `params.max_new_tokens` is resolved.
        Everything else waits for blocks."""
        assert params.max_new_tokens is not None, "resolve max_new_tokens from the prompt's length first"
        prompts = params.n * self.kv.blocks_for(prompt_tokens)
        longest = self.kv.blocks_for(prompt_tokens + params.max_new_tokens)
        need = max(prompts, longest)
        if need > self.kv.total:
            raise TooLarge(f"this request needs {need:,} KV cache blocks of {self.kv.pool.block_size} tokens "
                           f"({params.n} x {prompt_tokens:,} prompt tokens; {prompt_tokens + params.max_new_tokens:,} "
                           f"tokens for one sequence at its longest), over the server's {self.kv.total:,} "
                           "(--kv-cache-memory-gb); send a shorter prompt or ask for fewer tokens")
        params.check_vocab(self.model.cfg.vocab_size)
        if params.allowed_token_ids and not self._space.columns(params.allowed_token_ids):
            raise SamplingError("allowed_token_ids names no token this model's tokenizer can write")

    def submit(self, job: Generation) -> None:
        """Queue a generation `check`ed when it was prepared (nothing is checked again here)."""
        assert job.params.max_new_tokens is not None and job.params.n <= self.max_num_seqs, "submit a prepared request"
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
            waiting = sum(item.params.n if isinstance(item, Generation) else 1 for item in self._waiting)
        return len(self._running) + sum(p.sequences for p in self._prefilling), waiting

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
        for job in {id(j): j for j in (item if isinstance(item, Generation) else item.job
                                       for item in waiting)}.values():
            self._output.end(job, closed)
        self._end_admitted(closed)
        self._output.close()

    def _end_admitted(self, exc: BaseException) -> None:
        """End the admitted jobs (prefilling or running) with `exc` and drop them; the waiting
        ones were not in the step and stay queued."""
        jobs = {id(j): j for j in [*(p.job for p in self._prefilling), *(s.job for s in self._running)]}
        for job in jobs.values():
            self._fail(job, exc)
        for prefill in self._prefilling:
            for cache in prefill.caches:
                self.kv.free(cache)
        for sequence in self._running:
            self.kv.free(sequence.cache)
        self._prefilling, self._running = [], []
        self._report()

    def _fail(self, job: Generation, exc: BaseException) -> None:
        """`job` ends with `exc`; its sequences still queued (preempted) leave at the next step."""
        job.dropped = True
        self._output.end(job, exc)

    def _step(self) -> None:
        self._drop_gone()
        self._make_room()
        self._admit()
        batch = self._running
        budget: float = self.max_num_batched_tokens - len(batch)
        keys_per_token = self.keys_per_token if batch else None  # alone, a chunk is bounded by its tokens
        chunks: list[tuple[_Prefill, int]] = []
        for prefill in self._prefilling:
            remaining = prefill.total - prefill.done
            take = prefill_chunk(budget, prefill.done, remaining, keys_per_token)
            if not chunks:
                take = max(take, 1)  # the oldest prompt always moves on
            if not take:
                break
            chunks.append((prefill, take))
            budget -= chunk_cost(take, prefill.done, keys_per_token)
        self.last_batch = len(batch)
        if batch or chunks:
            started = time.perf_counter()
            self._forward(batch, chunks)
            if self.metrics is not None:
                self.metrics.trunk_step_seconds.observe(time.perf_counter() - started)
        self._report()

    def _forward(self, batch: list[_Sequence], chunks: list[tuple[_Prefill, int]]) -> None:
        """One forward of the step: a token for every running sequence and the prompt chunks; the
        running ones sample their next token, a prompt whose last chunk this was starts."""
        caches = [s.cache for s in batch] + [prefill.caches[0] for prefill, _ in chunks]
        try:
            logits = decode_step(self.model, caches, [s.last for s in batch], self._space,
                                 [prefill.embeds[prefill.done:prefill.done + take] for prefill, take in chunks])
            samples = sample_batch(logits[:len(batch)], [s.sampler for s in batch])
        except Exception as exc:  # noqa: BLE001 - the step's jobs fail; the scheduler goes on
            log.exception("trunk step failed")
            for sequence in batch:
                self._fail(sequence.job, exc)
                self._finish(sequence)
            for prefill, _ in chunks:
                self._release(prefill)
                self._fail(prefill.job, exc)
            self._running = [s for s in self._running if s.cache is not None]
            return
        self._output.tokens([self._take(sequence, sample) for sequence, sample in zip(batch, samples, strict=True)])
        self._running = [s for s in batch if s.cache is not None]
        for (prefill, take), row in zip(chunks, logits[len(batch):], strict=True):
            prefill.done += take
            if prefill.done == prefill.total:
                self._prefilling.remove(prefill)
                if prefill.resumed is not None:
                    prefill.resumed.cache = prefill.caches[0]
                    prefill.resumed.admitted = prefill.admitted
                    self._running.append(prefill.resumed)
                else:
                    self._start(prefill, row[None])

    def _take(self, sequence: _Sequence, sample: Sample) -> tuple[Reply, Sample, str | None]:
        """A sequence's sampled token, recorded by its sampler: what the output processor gets of it;
        the sequence leaves at a stop token or its length (before its caller can hear the end)."""
        reason = sequence.sampler.take(sample.token_id)
        sequence.job.sampled(sequence.index, reason != "stop")
        if reason != "stop":
            sequence.last = sample.token_id
        if reason is not None:
            self._finish(sequence)
        return sequence.reply, sample, reason

    def _drop_gone(self) -> None:
        for sequence in self._running:
            if sequence.gone:
                self._finish(sequence)
        self._running = [s for s in self._running if s.cache is not None]
        for prefill in [p for p in self._prefilling if p.job.gone or (p.resumed and p.resumed.gone)]:
            self._release(prefill)
        with self._wake:
            self._waiting = deque(item for item in self._waiting if not item.gone)

    def _make_room(self) -> None:
        """The block each running sequence's next token needs, oldest admitted first; while the pool
        cannot give one, the most recently admitted holder (a running sequence or a prompt being
        prefilled, the asker included) is preempted. One sequence alone always fits (`check`)."""
        for sequence in sorted(self._running, key=lambda s: (s.admitted, s.index)):
            while sequence.cache is not None and not self.kv.grow(sequence.cache):
                self._preempt_latest()
        self._running = [s for s in self._running if s.cache is not None]

    def _preempt_latest(self) -> None:
        holders: list[_Sequence | _Prefill] = [*(s for s in self._running if s.cache is not None), *self._prefilling]
        victim = max(holders, key=lambda h: (h.admitted, h.index if isinstance(h, _Sequence) else 0))
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.kv_cache_preemptions.inc()
        log.info("KV cache full: preempting a sequence admitted at %d (%d blocks free of %d)", victim.admitted,
                 self.kv.pool.num_free, self.kv.total)
        if isinstance(victim, _Sequence):
            self.kv.free(victim.cache)
            victim.cache = None
            item: Generation | _Sequence = victim
        else:
            self._release(victim)
            item = victim.resumed or victim.job
        with self._wake:
            self._waiting.appendleft(item)

    def _admit(self) -> None:
        while True:
            with self._wake:
                if not self._waiting:
                    return
                item = self._waiting[0]
                if isinstance(item, _Sequence):
                    sequences, blocks = 1, self.kv.blocks_for(item.cached_tokens())
                else:
                    sequences, blocks = item.params.n, item.params.n * self.kv.blocks_for(len(item.prompt.ids))
                busy = bool(self._running or self._prefilling)
                seqs = len(self._running) + sum(p.sequences for p in self._prefilling) + sequences
                if seqs > self.max_num_seqs or not self.kv.admits(blocks, busy):
                    return
                self._waiting.popleft()
            job = item if isinstance(item, Generation) else item.job
            try:
                embeds = trunk_embeds(self.model, job.prompt, job.rows)
                if isinstance(item, _Sequence):  # its prompt and every output token but the one it decodes next
                    done = torch.tensor(item.sampler.tokens[:-1], dtype=torch.long, device=self.model.device)
                    embeds = torch.cat([embeds, self.model.embed_tokens(done).to(embeds.dtype)])
            except Exception as exc:  # noqa: BLE001 - this job's input (e.g. an id outside the vocabulary)
                self._fail(job, exc)
                continue
            caches = [self.kv.new_cache(embeds.shape[0]) for _ in range(sequences)]
            self._prefilling.append(_Prefill(job, embeds, caches, next(self._admissions),
                                             item if isinstance(item, _Sequence) else None))

    def _release(self, prefill: _Prefill) -> None:
        """A prompt leaves before it starts (its caller left, it failed, it is preempted): its blocks go back."""
        self._prefilling.remove(prefill)
        for cache in prefill.caches:
            self.kv.free(cache)

    def _start(self, prefill: _Prefill, logits: torch.Tensor) -> None:
        """The prompt is in: copy its cache into the job's other sequences, each samples its first token."""
        job, params = prefill.job, prefill.job.params
        first, *others = prefill.caches
        for cache in others:
            cache.copy_from(first)
        samplers = [Sampler(params, self._space, self.model.device, prompt_ids=job.prompt.ids, seed=params.seed_of(i))
                    for i in range(params.n)]
        sequences = [_Sequence(job, i, cache, sampler, Reply(job, i, self.tokenizer))
                     for i, (cache, sampler) in enumerate(zip(prefill.caches, samplers, strict=True))]
        for sequence in sequences:
            sequence.admitted = prefill.admitted
        job.open = params.n  # before any of its replies' tokens reaches the output processor
        first_tokens = sample_batch(logits.expand(params.n, -1), samplers)
        self._running += sequences
        self._output.tokens([self._take(sequence, sample) for sequence, sample in zip(sequences, first_tokens,
                                                                                       strict=True)])
        self._running = [s for s in self._running if s.cache is not None]

    def _finish(self, sequence: _Sequence) -> None:
        """A sequence leaves (its reply is finished, its caller left, its job failed): its blocks go back."""
        self.kv.free(sequence.cache)
        sequence.cache = None

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.running_sequences.set(len(self._running))
            self.metrics.waiting_generations.set(len(self._waiting) + len(self._prefilling))
            self.metrics.kv_cache_blocks_used.set(self.kv.used)
            self.metrics.kv_cache_used_bytes.set(self.kv.used * self.kv.block_bytes)
            self.metrics.kv_cache_allocated_bytes.set(self.kv.allocated_bytes)
