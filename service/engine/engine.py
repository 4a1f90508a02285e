"""The engine: the one road from image bytes (and chats holding them) to embedding rows, token
counts, prompts, encodings and generations. Transport-free and async-first: the gRPC server, every
batch engine and `kimi-vision embed` call it; none of them touches the pool, the tower or the trunk.

Every image takes the same path (`embed`): its header is read here, once (`vision.plan_image`:
sizes, token count, prompt, limits), its embedding looked up in the cache by content hash, and on a
miss its encoded bytes and that plan go to one encoder worker, which decodes, preprocesses and
encodes it. An image refused here or by the worker gets the same error, prefixed with where the
request holds it, and is counted once (`_named`).

Where work runs: header reads, hashing, template rendering and Preprocess's pixels on `cpu_executor`
threads (Pillow and numpy release the GIL); decoding and the tower in the pool's worker processes;
everything that touches the trunk on the scheduler's single thread (`scheduler.py`: continuous
batching of every running generation, chunked prefill, admission by KV-cache budget), so
generations share each step instead of oversubscribing the cores. The event loop only moves bytes
and futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import torch
from PIL import Image

from service import tracing
from service.cpus import cpu_budget
from service.engine.allocator import KEEP_FREED_BYTES, keep_freed_memory
from service.engine.cache import EmbedCache
from service.engine.identity import checkpoint_fingerprint, content_hash
from service.engine.pool import EncodeError, EncoderPool
from service.engine.scheduler import Choice, GenerationResult, Job, Prompt, Scheduler, default_kv_cache_bytes
from service.engine.vllm_ec import DEFAULT_MODEL_ID, HASH_ALGORITHMS, item_key, write_ec
from service.errors import BadRequest, NotConfigured, TooLarge
from service.metrics import Metrics
from textcore.chat import ChatError, check_chat_kwargs, render
from textcore.generate import SamplingParams
from textcore.model import KimiLinearForCausalLM
from textcore.splice import Expanded, Span, expand_media_pads, position_ids, prompt_ids
from textcore.tokenizer import MEDIA_PAD_ID, NUM_BASE_TOKENS, Tokenizer
from vision.checkpoint import Checkpoint
from vision.decode import DEFAULT_LIMITS, Limits
from vision.errors import ImageError
from vision.options import DEFAULT_OPTIONS, ImageOptions
from vision.preprocess import ImagePlan, Preprocessed, plan_image, preprocess_image

log = logging.getLogger(__name__)

Components = Literal["all", "vision"]
COMPONENTS = ("all", "vision")
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# What goes in and comes out


@dataclass(frozen=True)
class ImageInput:
    data: bytes
    options: ImageOptions = DEFAULT_OPTIONS
    where: str = ""  # where a chat holds it ("messages[0].content[1]"), prefixed to its errors
    uuid: str | None = None  # a client's own id for the item: vLLM uses it verbatim as its mm_hash


@dataclass
class ChatInput:
    """A chat in the template's form: each image part is `{"type": "image"}`, and `images` holds
    those images in the order the template meets them (each labelled with its place)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    images: list[ImageInput] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_chat_kwargs(self.kwargs)
        places = [f"messages[{i}].content[{k}]" for i, m in enumerate(self.messages)
                  if isinstance(m.get("content"), list)
                  for k, part in enumerate(m["content"]) if isinstance(part, dict) and part.get("type") == "image"]
        if len(places) != len(self.images):
            raise ChatError(f"the chat has {len(places)} image parts but {len(self.images)} images were given")
        self.images = [image if image.where else dataclasses.replace(image, where=place)
                       for image, place in zip(self.images, places, strict=True)]


@dataclass(frozen=True)
class ImageEmbedding:
    """One image's projector output and what the prompt needs to know about it."""

    content_hash: str
    rows: torch.Tensor  # [num_tokens, hidden], CPU
    grid_thw: tuple[int, int, int]
    num_tokens: int
    prompt: str
    orig_size: tuple[int, int]  # (width, height) as decoded, before any resize: what `prompt` names
    cached: bool = False


class ChatTokens(NamedTuple):
    total: int  # after expansion
    image_tokens: list[int]


@dataclass(frozen=True)
class Encoding:
    """A chat ready for another engine to prefill: the prompt with each media_pad expanded to its
    image's token count, the re-laid position ids, where each image sits, and its rows."""

    input_ids: list[int]
    position_ids: list[int]
    spans: list[Span]
    embeddings: list[ImageEmbedding]
    mm_hashes: list[str]  # each image's key in vLLM's encoder cache (vllm_ec.item_key)
    ec_paths: list[Path]  # the vLLM encoder-cache file of each image, when exported (else empty)


@dataclass(frozen=True)
class EngineConfig:
    checkpoint: str | os.PathLike[str]  # resolved by the caller (the CLI resolves the embedded default)
    devices: str = "auto"  # encoder pool: auto | cpu:N | cuda:0,1
    threads_per_worker: int | None = None  # torch/OpenCV threads per encoder worker (None: usable CPUs / workers)
    patchify: str = "auto"  # where encoder workers build the float patches: auto (GPU: device) | device | host
    components: Components = "all"  # "vision": tokenizer, tower and projector only; no trunk is loaded
    # The model id vLLM runs (`vllm serve MODEL`): it keys vLLM's mm_hash of every image, and names
    # the model to OpenAI clients. None: the checkpoint's `_name_or_path`, else DEFAULT_MODEL_ID.
    model_id: str | None = None
    served_model_names: tuple[str, ...] = ()  # names a request's `model` may give (default: the model id)
    hash_algorithm: str = "blake3"  # vLLM's --mm-hasher-algorithm: blake3 | sha256 | sha512
    limits: Limits = DEFAULT_LIMITS  # per image
    max_images: int = 16  # per request
    max_request_pixels: int = 200_000_000  # decoded pixels of all of a request's images together
    cache_bytes: int = 1 << 30
    ec_export_dir: str | os.PathLike[str] | None = None  # where vLLM encoder-cache files may be written
    # cpu_executor's threads (default: the usable CPUs, service.cpus, at least 2)
    cpu_threads: int = field(default_factory=lambda: max(2, cpu_budget().usable))
    # Free memory each malloc arena keeps for the next image (service.engine.allocator), in this
    # process and in each encoder worker; 0 leaves their allocators as they are.
    keep_freed_bytes: int = KEEP_FREED_BYTES
    # Prompt plus generated tokens of one request, as vLLM's --max-model-len (None: the trunk's
    # max_position_embeddings, the checkpoint's context length).
    max_model_len: int | None = None
    # The trunk's scheduler (vLLM's names): sequences decoding together, tokens per engine step
    # (decode tokens plus prefill chunks), and the budget of the admitted generations' worst-case
    # caches (None: scheduler.KV_MEMORY_FRACTION of the trunk device's memory).
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.components not in COMPONENTS:
            raise ValueError(f"components must be one of {COMPONENTS}, got {self.components!r}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {self.hash_algorithm!r}")
        for name in ("max_images", "max_request_pixels", "cpu_threads", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one), got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence takes a token of each step")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


def decodable_ids(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size]: ids the tokenizer can turn into text (its base ranks and the specials).

    The tiny default keeps the release's 163,840-row head but its vocabulary has only a few hundred
    base tokens; its random head would otherwise sample ids that have no text. With the release
    tokenizer every id decodes and the mask is all true."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[:tokenizer.num_base_tokens] = True
    mask[NUM_BASE_TOKENS:tokenizer.vocab_size] = True
    return mask


@contextlib.contextmanager
def _named(image: ImageInput, metrics: Metrics) -> Iterator[None]:
    """Count a refused image by its kind, and prefix its error with where the image sits in the
    request (same error class): the one place for both, whether the header (here) or the pixels (in
    a worker) refused it."""
    try:
        yield
    except ImageError as exc:
        metrics.images_refused.labels(reason=exc.kind).inc()
        if not image.where:
            raise
        raise type(exc)(f"{image.where}: {exc}") from None


def _name_or_path(checkpoint_dir: Path) -> str | None:
    """The checkpoint's own model id (`_name_or_path` in its config.json), if it has one."""
    try:
        name = json.loads((checkpoint_dir / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) and name else None


def _probe_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# The engine


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, pool: EncoderPool,
                 model: KimiLinearForCausalLM | None = None, metrics: Metrics | None = None) -> None:
        if (model is None) != (config.components == "vision"):
            trunk = "missing" if model is None else "given"
            raise ValueError(f"components={config.components!r} but the trunk is {trunk}")
        self.config = config
        self.checkpoint_dir = Path(config.checkpoint)
        self.fingerprint = checkpoint_fingerprint(self.checkpoint_dir)  # the model's one identity
        self.model_id = config.model_id or _name_or_path(self.checkpoint_dir) or DEFAULT_MODEL_ID
        self.served_model_names = config.served_model_names or (self.model_id,)
        self.tokenizer = tokenizer
        self.pool = pool
        self.model = model
        self.max_model_len = config.max_model_len  # None without the trunk: nothing is generated
        if model is not None:
            context = model.cfg.max_position_embeddings
            if self.max_model_len is not None and self.max_model_len > context:
                raise ValueError(f"max_model_len {self.max_model_len} is larger than the model's context length "
                                 f"{context} (max_position_embeddings in the checkpoint's config)")
            self.max_model_len = self.max_model_len or context
        self.cache: EmbedCache[ImageEmbedding] = EmbedCache(config.cache_bytes)
        self.metrics = metrics or Metrics()
        self.cpu_executor = ThreadPoolExecutor(config.cpu_threads, thread_name_prefix="kimi-vision-cpu")
        self.scheduler: Scheduler | None = None
        if model is not None:
            budget = config.kv_cache_bytes or default_kv_cache_bytes(model.device)
            self.scheduler = Scheduler(model, tokenizer, max_num_seqs=config.max_num_seqs,
                                       max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=budget,
                                       allowed_ids=decodable_ids(tokenizer, model.cfg.vocab_size), metrics=self.metrics)
            longest = self.scheduler.sequence_bytes(self.max_model_len)
            if longest > budget:  # as vLLM refuses to start: one sequence of the model length must fit
                self.scheduler.close()
                raise ValueError(f"one sequence of the model length ({self.max_model_len:,} tokens) needs "
                                 f"{longest:,} bytes of cache, over the KV cache budget of {budget:,} bytes: lower "
                                 "--max-model-len or raise --kv-cache-memory-gb")

    @classmethod
    def load(cls, config: EngineConfig, metrics: Metrics | None = None) -> Engine:
        """Load the tokenizer, the encoder pool and (unless `components="vision"`) the trunk.
        Blocking; minutes for the real model."""
        if config.keep_freed_bytes and not keep_freed_memory(config.keep_freed_bytes):
            log.warning("not glibc: freed image buffers go back to the kernel (each large decode pays its page "
                        "faults again)")
        directory = Path(config.checkpoint)
        Checkpoint(directory).close()  # a missing or broken checkpoint is named before anything starts
        tokenizer = Tokenizer.from_pretrained(directory)
        pool = EncoderPool(directory, config.devices, limits=config.limits,
                           threads_per_worker=config.threads_per_worker, patchify=config.patchify,
                           keep_freed_bytes=config.keep_freed_bytes)
        log.info("encoder workers: %s (%d torch/OpenCV threads each); %d request threads", ", ".join(pool.devices),
                 pool.threads_per_worker, config.cpu_threads)
        model = None
        try:
            if config.components == "all":
                # The trunk shares the first GPU with encoder worker 0 when there is one; on CPU it
                # runs in float32 (bf16 matmuls are slow and inexact there), like the tower.
                first = pool.devices[0]
                device, dtype = (first, torch.bfloat16) if first.startswith("cuda") else ("cpu", torch.float32)
                model = KimiLinearForCausalLM.from_checkpoint(directory, dtype=dtype, device=device)
                if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                    cpu_workers = sum(d.startswith("cpu") for d in pool.devices)
                    budget = cpu_budget()
                    trunk_threads = budget.trunk_threads(cpu_workers * pool.threads_per_worker)
                    torch.set_num_threads(trunk_threads)
                    if budget.usable > trunk_threads:
                        # a prompt's attention (quadratic work in one op) takes every CPU while the
                        # workers have nothing to encode; the small ops stay on the trunk's own
                        model.set_attention_threads(lambda: budget.usable if pool.cpu_idle() else trunk_threads)
                        log.info("trunk: a prompt's attention over many keys takes %d torch threads while the "
                                 "CPU encoder workers are idle", budget.usable)
                log.info("trunk: %s, %d torch threads in this process", device, torch.get_num_threads())
            return cls(config, tokenizer, pool, model, metrics)
        except BaseException:  # a model that cannot load, or a configuration that cannot serve it
            pool.close()
            raise

    def close(self) -> None:
        self.pool.close()
        self.cpu_executor.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.close()

    def warmup(self) -> None:
        """One small image through preprocessing, every encoder worker and a generation of two
        tokens through the scheduler, its prompt a few words and the image's rows (the serving path:
        the cached step, the prefill and the absorbed decode attention, the sampler and its
        logprobs), so the first real request pays no first-call costs (and a broken setup fails
        before it serves). Blocking."""
        probe = ImageInput(_probe_png())
        self._preprocess(probe)
        plan = self._plan(probe)
        futures = [self.pool.submit(probe.data, probe.options, plan) for _ in self.pool.devices]
        rows = [future.result() for future in futures][0]
        if self.scheduler is None:
            return
        # Not a chat: the template alone is more tokens than a small --max-model-len (one sequence of
        # which is all the KV budget is known to hold).
        text = self.tokenizer.encode("warm up")
        prompt = Prompt([*text, *[MEDIA_PAD_ID] * plan.num_tokens], [Span(len(text), plan.num_tokens)], [rows],
                        thinking=False)
        ended: list[BaseException | None] = []
        done = threading.Event()

        def emit(item: Choice | BaseException | None) -> None:
            if not isinstance(item, Choice):
                ended.append(item)
                done.set()

        params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=1)
        self.scheduler.submit(Job(prompt, params, emit))
        done.wait()
        if ended[0] is not None:
            raise ended[0]

    # -- what callers read ----------------------------------------------------------------------

    @property
    def devices(self) -> list[str]:
        """One entry per encoder worker."""
        return list(self.pool.devices)

    @property
    def hidden_size(self) -> int:
        """Width of the embedding rows (the trunk's hidden size)."""
        return int(self.pool.config.text_hidden_size)

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names this model (no name: it does)."""
        return model is None or model in self.served_model_names

    @property
    def media_pad_id(self) -> int:
        return MEDIA_PAD_ID

    @property
    def serving(self) -> bool:
        """True while at least one encoder worker is ready."""
        return bool(self.pool.health()["serving"])

    def health(self) -> dict[str, Any]:
        """Per-worker state (for health checks and metrics)."""
        return self.pool.health()

    def run_cpu(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run blocking CPU work (tensor conversions, serialisation) on the engine's CPU threads."""
        return asyncio.get_running_loop().run_in_executor(self.cpu_executor, fn, *args)

    # -- images -----------------------------------------------------------------------------------

    async def plan(self, image: ImageInput) -> ImagePlan:
        """Sizes, grid, token count and prompt, from the header alone (limits checked)."""
        return await self.run_cpu(self._plan, image)

    async def preprocess(self, image: ImageInput) -> Preprocessed:
        """The exact model input (the padded uint8 image; its float patches on first use)."""
        with tracing.span("preprocess"):
            pre = await self.run_cpu(self._preprocess, image)
        self.metrics.tokens.labels(kind="image").inc(pre.num_tokens)
        return pre

    async def embed(self, images: Sequence[ImageInput], *,
                    prepared: Sequence[tuple[ImagePlan, str]] | None = None) -> list[ImageEmbedding]:
        """Embeddings of `images`, in order: the one function that turns image bytes into rows.

        Every image's header is read first (limits, the request's caps), unless the caller has
        (`prepared`: `_prepare`'s plans and keys, so a header is read once per process). Cache hits are served as
        they are; each distinct missing image is queued on the pool as soon as it is hashed, so the
        images spread over the workers. If the call is cancelled (an RPC's deadline or cancellation)
        or one image fails, the images still waiting in the pool are withdrawn (not encoded); one a
        worker has already started runs to the end."""
        if not images:
            return []
        if prepared is None:
            with tracing.span("preprocess", images=len(images)):
                prepared = await self.run_cpu(self._prepare, images)
        found: dict[str, ImageEmbedding] = {}
        missing: dict[str, tuple[ImageInput, ImagePlan]] = {}
        for image, (plan, key) in zip(images, prepared, strict=True):
            if key in found or key in missing:
                continue
            hit = self.cache.get(key)
            self.metrics.cache_lookups.labels(result="hit" if hit else "miss").inc()
            if hit is None:
                missing[key] = (image, plan)
            else:
                found[key] = dataclasses.replace(hit, cached=True)
        if missing:
            queued: list[concurrent.futures.Future] = []
            abandoned = threading.Event()

            async def encoded(image: ImageInput, future: concurrent.futures.Future) -> torch.Tensor:
                # A worker refuses pixels the header did not show: named and counted as a header refusal is.
                with _named(image, self.metrics):
                    return await asyncio.wrap_future(future)

            try:
                with tracing.span("encode", images=len(missing)):
                    futures = await asyncio.gather(*(self.run_cpu(self._submit, image, plan, queued, abandoned)
                                                     for image, plan in missing.values()))
                    rows = await asyncio.gather(*(encoded(image, future) for (image, _), future
                                                  in zip(missing.values(), futures, strict=True)))
            except BaseException:  # the caller will not use the other images: stop their work
                abandoned.set()
                for future in queued:
                    future.cancel()
                raise
            for (key, (image, plan)), r in zip(missing.items(), rows, strict=True):
                if r.shape[0] != plan.num_tokens:
                    raise EncodeError(f"{image.where or 'image'}: the encoder gave {r.shape[0]} rows for "
                                      f"{plan.num_tokens} tokens")
                found[key] = ImageEmbedding(key, r, plan.grid_thw, plan.num_tokens, plan.prompt, plan.orig_size)
                self.cache.put(key, found[key])
            self.metrics.cache_bytes.set(self.cache.nbytes)
        out = [found[key] for _, key in prepared]
        self.metrics.tokens.labels(kind="image").inc(sum(e.num_tokens for e in out))
        return out

    # -- chats --------------------------------------------------------------------------------------

    async def count_chat_tokens(self, chat: ChatInput) -> ChatTokens:
        """Prompt length after expansion, from image headers only (no pixels decoded)."""
        return await self.run_cpu(self._count_chat_tokens, chat)

    async def encode(self, chat: ChatInput, *, export_dtype: torch.dtype | None = None) -> Encoding:
        """The expanded prompt and the image rows: what another engine needs to prefill. With
        `export_dtype` each image's rows (cast to it: the consumer's activation dtype, usually
        bf16) are also written under `ec_export_dir` in the layout of vLLM's shared-storage
        encoder-cache connector, named by the key vLLM looks the image up by, before this returns."""
        directory = self.config.ec_export_dir
        if export_dtype is not None and directory is None:
            raise NotConfigured("exporting vLLM encoder-cache files needs the server to run with --ec-export-dir")
        embeddings = await self.embed(chat.images)
        ids = await self.run_cpu(self._prompt, chat, [e.prompt for e in embeddings])
        expanded = expand_media_pads(ids, [e.num_tokens for e in embeddings], MEDIA_PAD_ID)
        positions = position_ids(torch.ones(len(expanded.input_ids), dtype=torch.long)).tolist()
        keys = [self.vllm_key(image) for image in chat.images]
        ec_paths: list[Path] = []
        if export_dtype is not None:
            ec_paths = await self.run_cpu(lambda: [write_ec(directory, key, e.rows.to(export_dtype))
                                                   for key, e in zip(keys, embeddings, strict=True)])
        self.metrics.tokens.labels(kind="prompt").inc(len(expanded.input_ids))
        return Encoding(expanded.input_ids, positions, expanded.spans, embeddings, keys, ec_paths)

    def vllm_key(self, image: ImageInput) -> str:
        """The key vLLM files `image` under in its encoder cache (its uuid, else vLLM's mm_hash)."""
        return item_key(image.data, image.uuid, self.model_id, self.config.hash_algorithm)

    def sampling(self, max_new_tokens: int | None = None, **options: Any) -> SamplingParams:
        """Sampling parameters (`max_new_tokens` None: up to the model length, as in vLLM;
        `options`: the other `SamplingParams` fields); `SamplingParams` checks the ranges (a
        `SamplingError`, bad input). A `max_new_tokens` no prompt could fit under the model length,
        or more sequences than decode together, is refused here, before anything is read."""
        if max_new_tokens is not None and self.max_model_len is not None and max_new_tokens >= self.max_model_len:
            raise BadRequest(self._too_long(max_new_tokens, None))
        params = SamplingParams(max_new_tokens=max_new_tokens, **options)
        if self.scheduler is not None:
            self.scheduler.check_sequences(params)
        return params

    def _too_long(self, asked: int | None, prompt: int | None) -> str:
        """vLLM's words for a request over the model length (`prompt` None: not counted yet, at
        least one token)."""
        limit = self.max_model_len
        if asked is None:
            return (f"This model's maximum context length is {limit} tokens. However, your request has {prompt} "
                    "input tokens. Please reduce the length of the input messages.")
        has = f"{prompt} input tokens ({asked} > {limit} - {prompt})" if prompt is not None else (
            f"at least 1 input token ({asked} > {limit} - 1)")
        return (f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum context "
                f"length is {limit} tokens and your request has {has}.")

    def _fit(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """`params` with its new tokens within the model length after a prompt of `prompt_tokens`
        (absent: all the room left), or the refusal."""
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise BadRequest(self._too_long(None, prompt_tokens))
        if params.max_new_tokens is None:
            return dataclasses.replace(params, max_new_tokens=limit - prompt_tokens)
        if prompt_tokens + params.max_new_tokens > limit:
            raise BadRequest(self._too_long(params.max_new_tokens, prompt_tokens))
        return params

    async def generate(self, chat: ChatInput, params: SamplingParams) -> AsyncIterator[Choice]:
        """Prefill the spliced prompt and decode `params.n` replies in the trunk's batch: yields
        `Choice` items as they happen (each reply's parser events: reasoning and content deltas,
        tool calls, protocol errors; its tokens' `Logprobs` when asked for), each reply ending with
        its `GenerationResult`. Leaving early (the caller stops iterating or is cancelled) takes the
        replies out of the batch at the scheduler's next step and frees their caches."""
        if self.scheduler is None:
            raise NotConfigured("this server runs the vision components only (components=vision): generation "
                                "needs the trunk; serve with --components all")
        if chat.kwargs.get("add_generation_prompt") is False:
            raise BadRequest("generation always adds the generation prompt; drop add_generation_prompt")
        # The cost is known before any pixel is decoded: the prompt, its images counted from their
        # headers, against the model length, then what the scheduler can ever run (the KV budget).
        with tracing.span("preprocess", images=len(chat.images)):
            prepared = await self.run_cpu(self._prepare, chat.images)
            expanded, thinking = await self.run_cpu(self._chat_prompt, chat, [plan for plan, _ in prepared])
        params = self._fit(params, len(expanded.input_ids))
        scheduler = self.scheduler
        scheduler.check(len(expanded.input_ids), params)
        embeddings = await self.embed(chat.images, prepared=prepared)
        prompt = Prompt(expanded.input_ids, expanded.spans, [e.rows for e in embeddings], thinking)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Choice | BaseException | None] = asyncio.Queue()

        def emit(item: Choice | BaseException | None) -> None:  # on the scheduler's thread
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
                loop.call_soon_threadsafe(items.put_nowait, item)

        job = Job(prompt, params, emit)
        completion = 0
        try:
            with tracing.span("generate", max_new_tokens=params.max_new_tokens, n=params.n) as span:
                scheduler.submit(job)
                while (item := await items.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item.item, GenerationResult):
                        completion += item.item.completion_tokens
                    yield item
                if span is not None:
                    span.set_attributes({"prompt_tokens": len(prompt.ids), "completion_tokens": completion})
        finally:
            job.cancelled.set()  # the scheduler drops the job at its next step if we are leaving early
        self.metrics.tokens.labels(kind="prompt").inc(len(prompt.ids))
        self.metrics.tokens.labels(kind="generated").inc(completion)

    # -- blocking parts (executor threads) ----------------------------------------------------------

    def _plan(self, image: ImageInput) -> ImagePlan:
        with _named(image, self.metrics):
            return plan_image(image.data, image.options, self.config.limits)

    def _preprocess(self, image: ImageInput) -> Preprocessed:
        with _named(image, self.metrics):
            return preprocess_image(image.data, image.options, self.config.limits)

    def check_image_count(self, count: int) -> None:
        """The request cap on images (a face checks it before fetching any)."""
        if count > self.config.max_images:
            raise TooLarge(f"too many images: {count}; this server takes at most {self.config.max_images} per request")

    def _plans(self, images: Sequence[ImageInput]) -> list[ImagePlan]:
        """Every image's plan, with the request's caps: the image count, then all pixels together."""
        cfg = self.config
        self.check_image_count(len(images))
        plans = [self._plan(image) for image in images]
        total = sum(w * h for w, h in (plan.orig_size for plan in plans))
        if total > cfg.max_request_pixels:
            raise TooLarge(f"the request's images hold {total} pixels; the limit is {cfg.max_request_pixels}")
        return plans

    def _prepare(self, images: Sequence[ImageInput]) -> list[tuple[ImagePlan, str]]:
        plans = self._plans(images)
        return [(plan, content_hash(image.data, image.options, self.fingerprint))
                for image, plan in zip(images, plans, strict=True)]

    def _submit(self, image: ImageInput, plan: ImagePlan, queued: list[concurrent.futures.Future],
                abandoned: threading.Event) -> concurrent.futures.Future:
        """Queue on the pool (off the event loop: a large image's bytes are copied into shared
        memory). The pool future joins `queued`; if the caller gave up meanwhile (`abandoned`), it
        is cancelled at once."""
        future = self.pool.submit(image.data, image.options, plan)
        queued.append(future)  # before the check: a caller giving up now finds it in `queued`
        if abandoned.is_set():
            future.cancel()
        return future

    def _prompt(self, chat: ChatInput, image_prompts: Sequence[str]) -> list[int]:
        return prompt_ids(self.tokenizer, chat.messages, chat.tools, image_prompts, **chat.kwargs)

    def _count_chat_tokens(self, chat: ChatInput) -> ChatTokens:
        return self._prompt_tokens(chat, self._plans(chat.images))

    def _prompt_tokens(self, chat: ChatInput, plans: Sequence[ImagePlan]) -> ChatTokens:
        expanded, _ = self._chat_prompt(chat, plans)
        return ChatTokens(len(expanded.input_ids), [plan.num_tokens for plan in plans])

    def _chat_prompt(self, chat: ChatInput, images: Sequence[ImagePlan | ImageEmbedding]) -> tuple[Expanded, bool]:
        """The chat's prompt, rendered and tokenized once, each media_pad expanded to its image's
        token count (`images`: each image's prompt and count, from its header's plan or its
        embedding), and whether the generation prompt opens a think element (blocking)."""
        segments = render(chat.messages, chat.tools, image_prompts=[image.prompt for image in images], **chat.kwargs)
        # The generation prompt ends `<|open|>think<|sep|>` or `<|open|>response<|sep|>`.
        thinking = len(segments) >= 2 and segments[-2].text == "think"
        ids = self.tokenizer.encode_segments(segments)
        return expand_media_pads(ids, [image.num_tokens for image in images], MEDIA_PAD_ID), thinking
