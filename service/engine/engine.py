"""The engine: the one road from media bytes (and chats holding them) to embedding rows, prompts,
encodings and generations. Transport-free and async: every face, every batch engine and
`kimi-vision embed` call it; none of them touches the pool, the tower or the trunk.

A request takes two steps before any work (`service.engine.inputs`): `check` (the cheap rules,
before a byte is read or fetched) and `prepare` (each item's header read once, its plan and
content key; the prompt rendered once; the sampling resolved and the KV budget checked). `embed`,
`encode` and `generate` start from the `Prepared` value and check nothing again. An item's
embedding is looked up in the cache by content key and, on a miss, its encoded bytes and plan go
to one encoder worker, which decodes, preprocesses and encodes it; an item refused by its header
or by the worker gets the same error, prefixed with where the request holds it, counted once.

Where work runs: header reads, hashing, template rendering and Preprocess's pixels on `cpu_executor`
threads (Pillow and numpy release the GIL); decoding and the tower in the pool's worker processes;
everything that touches the trunk on the scheduler's single thread (`scheduler.py`: continuous
batching, chunked prefill, admission by KV-cache budget). The event loop only moves bytes and futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from service import tracing
from service.engine.cache import EmbedCache
from service.engine.config import DEFAULT_MODEL_ID, EngineConfig
from service.engine.identity import checkpoint_fingerprint
from service.engine.inputs import (
    ChatInput,
    Checked,
    HasModality,
    MediaInput,
    PlannedMedia,
    Prepared,
    Preparer,
    Prompt,
    RequestLimits,
    named_refusal,
)
from service.engine.loading import decodable_ids, load_engine, name_or_path, warm_up
from service.engine.pool import EncodeError, EncoderPool
from service.engine.scheduler import Choice, Generation, GenerationResult, Scheduler, default_kv_cache_bytes
from service.engine.store import Store, StoreConfig
from service.metrics import Metrics, TrunkLoad
from textcore.generate import SamplingParams
from textcore.model import KimiLinearForCausalLM
from textcore.splice import Span, position_ids
from textcore.tokenizer import Tokenizer
from vision.options import DEFAULT_OPTIONS
from vision.preprocess import Preprocessed

T = TypeVar("T")


@dataclass(frozen=True)
class MediaEmbedding:
    """One media item's projector output and what a prompt needs to know about it."""

    content_hash: str
    rows: torch.Tensor  # [num_tokens, hidden], CPU
    grid_thw: tuple[int, int, int]
    num_tokens: int
    prompt: str
    orig_size: tuple[int, int]  # (width, height) as decoded, before any resize: what `prompt` names
    cached: bool = False


@dataclass(frozen=True)
class Encoding:
    """What another engine needs to prefill: the request's items and their rows, and for a chat its
    prompt (each media_pad expanded) with the re-laid position ids."""

    media: list[MediaInput]
    embeddings: list[MediaEmbedding]
    prompt: Prompt | None = None
    position_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.ids if self.prompt is not None else []

    @property
    def spans(self) -> list[Span]:
        return self.prompt.spans if self.prompt is not None else []


@dataclass
class _Flight:
    """One item's encode under way and how many calls wait for it."""

    task: asyncio.Future[MediaEmbedding]
    waiters: int = 0


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, pool: EncoderPool,
                 model: KimiLinearForCausalLM | None = None, metrics: Metrics | None = None) -> None:
        if (model is None) != (config.components == "vision"):
            trunk = "missing" if model is None else "given"
            raise ValueError(f"components={config.components!r} but the trunk is {trunk}")
        self.config = config
        self.checkpoint_dir = Path(config.checkpoint)
        self.fingerprint = checkpoint_fingerprint(self.checkpoint_dir)  # the model's one identity
        self.model_id = config.model_id or name_or_path(self.checkpoint_dir) or DEFAULT_MODEL_ID
        self.served_model_names = config.served_model_names or (self.model_id,)
        self.tokenizer = tokenizer
        self.pool = pool
        self.model = model
        self.metrics = metrics or Metrics()
        self.cache: EmbedCache[MediaEmbedding] = EmbedCache(config.cache_bytes)
        self._flights: dict[str, _Flight] = {}  # encodes under way, by content key (`_encoded`)
        self.store: Store | None = None  # the export directory, shared by a fleet (`_encode_item`)
        if config.ec_export_dir is not None:
            self.store = Store(StoreConfig(Path(config.ec_export_dir), self.model_id, config.hash_algorithm,
                                           self.fingerprint, config.ec_client_uuids, config.ec_lease_seconds,
                                           config.ec_store_max_bytes, config.ec_store_min_age_s), self.metrics)
        self.cpu_executor = ThreadPoolExecutor(config.cpu_threads, thread_name_prefix="kimi-vision-cpu")
        self.scheduler: Scheduler | None = None
        max_model_len = config.max_model_len  # None without the trunk: nothing is generated
        if model is not None:
            context = model.cfg.max_position_embeddings
            if max_model_len is not None and max_model_len > context:
                raise ValueError(f"max_model_len {max_model_len} is larger than the model's context length "
                                 f"{context} (max_position_embeddings in the checkpoint's config)")
            max_model_len = max_model_len or context
            budget = config.kv_cache_bytes or default_kv_cache_bytes(model.device)
            self.scheduler = Scheduler(model, tokenizer, max_num_seqs=config.max_num_seqs,
                                       max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=budget,
                                       allowed_ids=decodable_ids(tokenizer, model.cfg.vocab_size), metrics=self.metrics)
            if max_model_len > self.scheduler.kv.max_tokens:  # as vLLM refuses to start: one such sequence must fit
                self.scheduler.close()
                raise ValueError(f"one sequence of the model length ({max_model_len:,} tokens) needs "
                                 f"{self.scheduler.kv.blocks_for(max_model_len) * self.scheduler.kv.block_bytes:,} "
                                 f"bytes of KV cache, over the budget of {budget:,} bytes: lower --max-model-len or "
                                 "raise --kv-cache-memory-gb")
        self.max_model_len = max_model_len
        self.series = self.metrics.vllm_series(self.served_model_names[0])
        if self.scheduler is not None:
            self.metrics.read_trunk(self.served_model_names[0], self.trunk_load)
        limits = RequestLimits(config.limits, config.max_images, config.max_request_pixels, max_model_len)
        self.preparer = Preparer(tokenizer, limits, self.fingerprint, self.metrics, self.scheduler)

    @classmethod
    def load(cls, config: EngineConfig, metrics: Metrics | None = None) -> Engine:
        """Load the tokenizer, the encoder pool and (unless `components="vision"`) the trunk. Blocking."""
        return load_engine(cls, config, metrics)

    def warmup(self) -> None:
        warm_up(self)

    def close(self) -> None:
        self.pool.close()
        self.cpu_executor.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.close()

    # -- what callers read ----------------------------------------------------------------------

    @property
    def devices(self) -> list[str]:
        """One entry per encoder worker."""
        return list(self.pool.devices)

    @property
    def hidden_size(self) -> int:
        """Width of the embedding rows (the trunk's hidden size)."""
        return int(self.pool.config.text_hidden_size)

    @property
    def serving(self) -> bool:
        """True while at least one encoder worker is ready."""
        return bool(self.pool.health()["serving"])

    def health(self) -> dict[str, Any]:
        """Per-worker state (for health checks and metrics)."""
        return self.pool.health()

    def trunk_load(self) -> TrunkLoad:
        """The trunk's sequences running and waiting, and its KV cache in use (`kv_cache_usage`)."""
        assert self.scheduler is not None, "a trunk's load"
        running, waiting = self.scheduler.load
        return TrunkLoad(running, waiting, self.kv_cache_usage())

    def kv_cache_usage(self) -> float:
        """The share (0..1) of the KV cache pool's blocks the running sequences hold (vLLM's
        `kv_cache_usage_perc`): the one place that says how the scheduler's cache is counted."""
        assert self.scheduler is not None, "a trunk's KV cache"
        return self.scheduler.kv.used / self.scheduler.kv.total

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names this model (no name: it does)."""
        return model is None or model in self.served_model_names

    def run_cpu(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run blocking CPU work (tensor conversions, serialisation) on the engine's CPU threads."""
        return asyncio.get_running_loop().run_in_executor(self.cpu_executor, fn, *args)

    # -- a request, checked and prepared once ---------------------------------------------------

    def check(self, media: Sequence[HasModality], chat: ChatInput | None = None,
              params: SamplingParams | None = None) -> Checked:
        """The cheap rules, before any item is read (`Preparer.check`)."""
        return self.preparer.check(media, chat, params)

    async def prepare(self, checked: Checked, media: Sequence[MediaInput], chat: ChatInput | None = None) -> Prepared:
        """Plans, keys, the prompt and the resolved sampling, once (`Preparer.prepare`)."""
        with tracing.span("preprocess", images=len(media)):
            return await self.run_cpu(self.preparer.prepare, checked, media, chat)

    async def prepare_text(self, checked: Checked, prompt: str | Sequence[int], where: str) -> Prepared:
        """A completion's prompt, text or token ids (`Preparer.prepare_text`)."""
        return await self.run_cpu(self.preparer.prepare_text, checked, prompt, where)

    async def text_ids(self, text: str) -> list[int]:
        """`text`'s token ids, as a completion's prompt is read (`Preparer.text_ids`)."""
        return await self.run_cpu(self.preparer.text_ids, text)

    async def detokenize(self, ids: Sequence[int], where: str) -> str:
        """The text of token ids, each checked against the vocabulary (nothing skipped)."""
        checked = self.preparer.check_ids(ids, where)
        return await self.run_cpu(self.tokenizer.decode, checked)

    # -- work -----------------------------------------------------------------------------------

    async def preprocess(self, item: MediaInput) -> Preprocessed:
        """The exact model input (the padded uint8 image; its float patches on first use)."""
        self.check([item])
        with tracing.span("preprocess"):
            pre = await self.run_cpu(self.preparer.preprocess, item)
        self.metrics.tokens.labels(kind="image").inc(pre.num_tokens)
        return pre

    async def embed(self, request: Sequence[MediaInput] | Prepared) -> list[MediaEmbedding]:
        """Embeddings of the request's items, in order: the one function that turns media bytes into
        rows (a list of items is checked and prepared first).

        Cache hits are served as they are; each distinct missing item is queued on the pool, so the
        items spread over the workers, and an item already being encoded for another call is waited
        for, not encoded again (single flight, `_encoded`). If the call is cancelled (a deadline, a
        client gone) or one item fails, the items no other call waits for and still queued in the
        pool are withdrawn (not encoded); one a worker has already started runs to the end."""
        prepared = request if isinstance(request, Prepared) else await self.prepare(self.check(request), request)
        if not prepared.media:
            return []
        found: dict[str, MediaEmbedding] = {}
        missing: dict[str, PlannedMedia] = {}
        for planned in prepared.media:
            if planned.key in found or planned.key in missing:
                continue
            hit = self.cache.get(planned.key)
            self.metrics.cache_lookups.labels(result="hit" if hit else "miss").inc()
            if hit is None:
                missing[planned.key] = planned
            else:
                found[planned.key] = dataclasses.replace(hit, cached=True)
        if missing:
            with tracing.span("encode", images=len(missing)):
                found.update(await self._encoded(missing))
        out = [found[planned.key] for planned in prepared.media]
        self.metrics.tokens.labels(kind="image").inc(sum(e.num_tokens for e in out))
        return out

    async def encode(self, prepared: Prepared) -> Encoding:
        """The request's rows and, for a chat, its expanded prompt: what another engine needs to
        prefill (a transport in `service.epd` delivers it)."""
        embeddings = await self.embed(prepared)
        media = [planned.item for planned in prepared.media]
        if prepared.prompt is None:
            return Encoding(media, embeddings)
        positions = position_ids(torch.ones(len(prepared.prompt.ids), dtype=torch.long)).tolist()
        self.metrics.tokens.labels(kind="prompt").inc(len(prepared.prompt.ids))
        return Encoding(media, embeddings, prepared.prompt, positions)

    async def generate(self, prepared: Prepared,
                       counted: Callable[[int], None] | None = None) -> AsyncIterator[Choice]:
        """Prefill the spliced prompt and decode `params.n` replies in the trunk's batch: yields
        `Choice` items as they happen (each reply's parser events, its tokens' `Logprobs` when asked
        for), each reply ending with its `GenerationResult`. `counted(index)` is called on the
        event loop for each output token of reply `index`, before the items of its text. Leaving
        early (the caller stops iterating or is cancelled) takes the replies out of the batch at the
        scheduler's next step."""
        assert prepared.prompt is not None and prepared.params is not None, "generate a prepared generation"
        start = time.perf_counter()
        rows = [e.rows for e in await self.embed(prepared)]
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Choice | BaseException | None] = asyncio.Queue()
        series = self.series
        last: dict[int, float] = {}  # each reply's last token

        def emit(item: Choice | BaseException | None) -> None:  # on the scheduler's thread
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                loop.call_soon_threadsafe(items.put_nowait, item)

        def sampled(index: int, output: bool) -> None:  # on the scheduler's thread
            now = time.perf_counter()
            if not last:
                series.time_to_first_token.observe(now - start)
            elif index in last:
                series.inter_token_latency.observe(now - last[index])
            last[index] = now
            if output and counted is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(counted, index)

        generation = Generation(prepared.prompt, rows, prepared.params, emit, sampled=sampled)
        completion = 0
        try:
            with tracing.span("generate", max_new_tokens=prepared.params.max_new_tokens, n=prepared.params.n) as span:
                self.scheduler.submit(generation)
                while (item := await items.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item.item, GenerationResult):
                        completion += item.item.completion_tokens
                    yield item
                if span is not None:
                    span.set_attributes({"prompt_tokens": len(prepared.prompt.ids), "completion_tokens": completion})
        finally:
            generation.cancelled.set()  # the scheduler drops it at its next step if we are leaving early
        self.metrics.tokens.labels(kind="prompt").inc(len(prepared.prompt.ids))
        self.metrics.tokens.labels(kind="generated").inc(completion)
        series.prompt_tokens.inc(len(prepared.prompt.ids))
        series.generation_tokens.inc(completion)
        series.e2e_request_latency.observe(time.perf_counter() - start)

    async def _encoded(self, missing: dict[str, PlannedMedia]) -> dict[str, MediaEmbedding]:
        """Each missing item's embedding, one encode per key however many requests want it at once
        (single flight): the encode is a task of its own, so a caller that leaves (or whose other
        item failed) does not fail the others waiting for it; it is withdrawn once no one waits."""
        flights = [self._flight(key, planned) for key, planned in missing.items()]
        for flight in flights:
            flight.waiters += 1

        async def landed(flight: _Flight, planned: PlannedMedia) -> MediaEmbedding:
            # A refusal is named by where this call holds the item (and counted for it), not where
            # the call that started the flight did.
            with named_refusal(planned.item, self.metrics):
                return await asyncio.shield(flight.task)

        try:
            embeddings = await asyncio.gather(*map(landed, flights, missing.values()))
        finally:
            for flight in flights:
                flight.waiters -= 1
                if flight.waiters == 0 and not flight.task.done():
                    flight.task.cancel()
        return dict(zip(missing, embeddings, strict=True))

    def _flight(self, key: str, planned: PlannedMedia) -> _Flight:
        """The encode of `key` under way on this event loop, else a new one."""
        flight = self._flights.get(key)
        if flight is not None and flight.task.get_loop() is asyncio.get_running_loop():
            return flight
        flight = _Flight(asyncio.ensure_future(self._encode_item(planned)))
        self._flights[key] = flight
        flight.task.add_done_callback(lambda task: self._landed(key, flight))
        return flight

    def _landed(self, key: str, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.task.cancelled():
            flight.task.exception()  # its callers heard it; retrieved, so no "never retrieved" warning

    async def _encode_item(self, planned: PlannedMedia) -> MediaEmbedding:
        """One item's rows, checked and cached (here, so a flight whose first caller left still fills
        the cache for the rest): from the store when it holds them or another instance is encoding
        them, else from the tower (`_tower`). Only an item of the default preprocessing goes through
        the store: vLLM's key stands for that one."""
        plan = planned.plan
        key = None
        if self.store is not None and planned.item.options == DEFAULT_OPTIONS:
            key = await self.run_cpu(self.store.key, planned.item)
        if key is None:
            rows, stored = await self._tower(planned), False
        else:
            rows, stored = await self.store.through(key, (plan.num_tokens, self.hidden_size),
                                                    lambda: self._tower(planned), self.run_cpu,
                                                    planned.item.where or "image")
        embedding = MediaEmbedding(planned.key, rows, plan.grid_thw, plan.num_tokens, plan.prompt, plan.orig_size,
                                   cached=stored)
        self.cache.put(planned.key, embedding)
        self.metrics.cache_bytes.set(self.cache.nbytes)
        return embedding

    async def _tower(self, planned: PlannedMedia) -> torch.Tensor:
        """One item through the pool (queued off the event loop: a large item's bytes are copied into
        shared memory; withdrawn if still queued when the flight is cancelled)."""
        submitted: list[concurrent.futures.Future] = []
        abandoned = threading.Event()

        def submit() -> concurrent.futures.Future:
            future = self.pool.submit(planned.item, planned.plan)
            submitted.append(future)  # before the check: a cancel now finds it in `submitted`
            if abandoned.is_set():
                future.cancel()
            return future

        try:
            future = await self.run_cpu(submit)
            rows = await asyncio.wrap_future(future)  # a refusal is named by each caller (`_encoded`)
        except BaseException:  # no one will use the rows: stop the work if it has not started
            abandoned.set()
            for queued in submitted:
                queued.cancel()
            raise
        if rows.shape[0] != planned.plan.num_tokens:
            raise EncodeError(f"{planned.item.where or 'image'}: the encoder gave {rows.shape[0]} rows for "
                              f"{planned.plan.num_tokens} tokens")
        return rows
