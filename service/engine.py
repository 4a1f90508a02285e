"""The model side of the service, without any gRPC: one checkpoint's tokenizer, trunk and encoder
pool, the embedding cache, and the executors the server runs blocking work on.

Threads: preprocessing and other CPU work run on `cpu_executor` (Pillow and numpy release the
GIL); everything that touches the trunk runs on a single `trunk_executor` thread, so requests
take turns on the trunk instead of oversubscribing the cores; the tower runs in the pool's worker
processes. Blocking methods here are called from those executors, never from the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from service.ec_export import write_ec
from service.embed_cache import EmbedCache, checkpoint_identity, content_hash
from service.metrics import Metrics
from service.splice import Expanded, expand_media_pads, prompt_ids, splice_rows
from textcore.chat import render

# Chat-template keyword arguments a request may set (besides thinking_effort, which has a field).
CHAT_KWARGS = ("add_generation_prompt", "thinking", "enable_thinking", "reasoning_effort", "tool_choice",
               "response_format", "response_schema")


@dataclass(frozen=True)
class ImageOptions:
    exif_transpose: bool = False
    max_tokens: int | None = None
    resize: str = "exact"

    def key(self) -> str:
        """vision's canonical name of these options (versioned with the preprocessing)."""
        from vision import options_key

        return options_key(max_tokens=self.max_tokens, exif_transpose=self.exif_transpose, resize=self.resize)


@dataclass(frozen=True)
class ImageInput:
    data: bytes
    options: ImageOptions = ImageOptions()
    where: str = ""  # where a chat holds it ("messages[0].content[1]"), prefixed to its errors


@dataclass
class ChatInput:
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    images: list[ImageInput] = field(default_factory=list)  # in the order the template meets them


@dataclass(frozen=True)
class ImageEmbedding:
    """One image's projector output and what the prompt needs to know about it."""

    content_hash: str
    rows: torch.Tensor  # [num_tokens, hidden], CPU
    grid_thw: tuple[int, int, int]
    num_tokens: int
    prompt: str
    cached: bool = False


class GenerationStopped(Exception):
    """Raised on the trunk thread when the RPC that asked for a generation has gone away."""


class ChatTokens(NamedTuple):
    total: int  # after expansion
    image_tokens: list[int]


@dataclass
class GenerationResult:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    image_tokens: int
    completion_tokens: int


@dataclass
class EngineConfig:
    checkpoint: str | None = None  # None -> the embedded tiny default
    devices: str = "auto"  # encoder pool: auto | cpu:N | cuda:0,1
    cache_bytes: int = 1 << 30
    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 64_000_000
    cpu_threads: int = max(2, os.cpu_count() or 2)
    # Free memory each malloc arena keeps for the next image (service.allocator); 0 leaves the
    # process's allocator as it is.
    keep_freed_bytes: int = 256 << 20
    default_max_new_tokens: int = 512
    max_new_tokens_limit: int = 8192


def decodable_ids(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size]: ids the tokenizer can turn into text (its base ranks and the specials).

    The tiny default keeps the release's 163,840-row head but its vocabulary has only a few hundred
    base tokens; its random head would otherwise sample ids that have no text. With the release
    tokenizer every id decodes and the mask is all true."""
    from textcore.tokenizer import NUM_BASE_TOKENS

    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[:tokenizer.num_base_tokens] = True
    mask[NUM_BASE_TOKENS:tokenizer.vocab_size] = True
    return mask


@contextlib.contextmanager
def _named(image: ImageInput) -> Iterator[None]:
    """Prefix an image error with where the image sits in the request (same error class)."""
    from vision.errors import ImageError

    try:
        yield
    except ImageError as exc:
        if not image.where:
            raise
        raise type(exc)(f"{image.where}: {exc}") from None


class Engine:
    def __init__(self, config: EngineConfig, checkpoint_dir: Path, tokenizer: Any, model: Any, pool: Any,
                 metrics: Metrics | None = None) -> None:
        from vision import Limits

        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_id = checkpoint_identity(checkpoint_dir)
        self.tokenizer = tokenizer
        self.model = model
        decodable = decodable_ids(tokenizer, model.cfg.vocab_size)
        self._allowed_ids = None if bool(decodable.all()) else decodable
        self.pool = pool
        self.hidden_size = int(pool.config.text_hidden_size)
        self.limits = Limits(max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels)
        self.cache = EmbedCache(config.cache_bytes)
        self.metrics = metrics or Metrics()
        self.cpu_executor = ThreadPoolExecutor(config.cpu_threads, thread_name_prefix="kimi-vision-cpu")
        self.trunk_executor = ThreadPoolExecutor(1, thread_name_prefix="kimi-vision-trunk")

    @classmethod
    def load(cls, config: EngineConfig, metrics: Metrics | None = None) -> Engine:
        """Load tokenizer, trunk and encoder pool (blocking; minutes for the real model)."""
        from service.allocator import keep_freed_memory
        from textcore.model import KimiLinearForCausalLM
        from textcore.tokenizer import Tokenizer
        from vision.pool import EncoderPool

        if config.keep_freed_bytes and not keep_freed_memory(config.keep_freed_bytes):
            logging.getLogger(__name__).warning("not glibc: freed image buffers go back to the kernel "
                                                "(each large decode pays its page faults again)")
        if config.checkpoint is None:
            from service.default_checkpoint import default_checkpoint_dir

            directory = Path(default_checkpoint_dir())
        else:
            directory = Path(config.checkpoint)
        tokenizer = Tokenizer.from_pretrained(directory)
        pool = EncoderPool(directory, config.devices)
        try:
            # The trunk shares the first GPU with encoder worker 0 when there is one; on CPU it runs
            # in float32 (bf16 matmuls are slow and inexact there), like the tower.
            first = pool.devices[0]
            device, dtype = (first, torch.bfloat16) if first.startswith("cuda") else ("cpu", torch.float32)
            model = KimiLinearForCausalLM.from_checkpoint(directory, dtype=dtype, device=device)
        except BaseException:
            pool.close()
            raise
        return cls(config, directory, tokenizer, model, pool, metrics)

    def close(self) -> None:
        self.pool.close()
        self.cpu_executor.shutdown(wait=False, cancel_futures=True)
        self.trunk_executor.shutdown(wait=False, cancel_futures=True)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One small image through preprocessing, every encoder worker and the trunk, so the first
        real request pays no first-call costs (and a broken setup fails before SERVING)."""
        import io

        import numpy as np
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8)).save(buf, "PNG")
        pre = self.preprocess(ImageInput(buf.getvalue()))
        rows = self.pool.encode([pre] * self.pool.num_workers)[0]
        ids = torch.tensor(self.tokenizer.encode("warm up"), dtype=torch.long, device=self.model.device)
        embeds = torch.cat([self.model.embed_tokens(ids), rows.to(self.model.device, self.model.dtype)])
        self.model(inputs_embeds=embeds[None], last_only=True)

    @property
    def media_pad_id(self) -> int:
        from textcore.tokenizer import MEDIA_PAD_ID

        return MEDIA_PAD_ID

    # -- executors ----------------------------------------------------------------------------

    def run_cpu(self, fn: Callable, *args: Any) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.cpu_executor, fn, *args)

    def run_trunk(self, fn: Callable, *args: Any) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.trunk_executor, fn, *args)

    # -- images (blocking) ----------------------------------------------------------------------

    def preprocess(self, image: ImageInput) -> Any:
        from vision import preprocess_image

        o = image.options
        with _named(image):
            return preprocess_image(image.data, max_tokens=o.max_tokens, exif_transpose=o.exif_transpose,
                                    resize=o.resize, limits=self.limits)

    def image_sizes(self, images: Sequence[ImageInput]) -> list[tuple[int, int]]:
        """Decoded (width, height) of each image from its header alone (limits checked)."""
        from vision.decode import open_header

        sizes = []
        for image in images:
            with _named(image):
                handle, header = open_header(image.data, self.limits)
            handle.close()
            sizes.append(header.size)
        return sizes

    def image_plan(self, image: ImageInput) -> tuple[str, int]:
        """(prompt, num_tokens) exactly as `preprocess` will give them, from the header alone."""
        from vision import plan_size
        from vision.decode import open_header, oriented_size
        from vision.preprocess import PROMPT_TEMPLATE

        o = image.options
        with _named(image):
            handle, header = open_header(image.data, self.limits, exif_transpose=o.exif_transpose)
        handle.close()
        plan = plan_size(*oriented_size(header), o.max_tokens)
        w, h = plan.orig_size
        return PROMPT_TEMPLATE.format(w=w, h=h), plan.num_tokens

    def count_image_tokens(self, image: ImageInput) -> int:
        return self.image_plan(image)[1]

    def image_key(self, image: ImageInput) -> str:
        return content_hash(image.data, image.options.key(), self.checkpoint_id)

    def _submit(self, image: ImageInput, queued: list[concurrent.futures.Future],
                abandoned: threading.Event) -> tuple[Any, concurrent.futures.Future]:
        """Preprocess and queue on the pool (both off the event loop: building the patches and
        copying them into shared memory take a while for a large image). The pool future joins
        `queued`; if the caller gave up meanwhile (`abandoned`), it is cancelled at once."""
        pre = self.preprocess(image)
        future = self.pool.submit(pre)
        queued.append(future)  # before the check: a caller giving up now finds it in `queued`
        if abandoned.is_set():
            future.cancel()
        return pre, future

    async def embed_images(self, images: Sequence[ImageInput]) -> list[ImageEmbedding]:
        """Embeddings of `images` in order. Cache hits are served as they are; each distinct missing
        image is preprocessed once and queued on the pool as soon as it is ready, so the images
        spread over the workers. If the call is cancelled (an RPC's deadline or cancellation) or one
        image fails, the images still waiting in the pool are withdrawn (not encoded); one a
        worker has already started runs to the end."""
        keys = [self.image_key(image) for image in images]
        found: dict[str, ImageEmbedding] = {}
        missing: dict[str, ImageInput] = {}
        for key, image in zip(keys, images, strict=True):
            if key in found or key in missing:
                continue
            hit = self.cache.get(key)
            self.metrics.cache_lookups.labels(result="hit" if hit else "miss").inc()
            if hit is None:
                missing[key] = image
            else:
                found[key] = dataclasses.replace(hit, cached=True)
        if missing:
            queued: list[concurrent.futures.Future] = []
            abandoned = threading.Event()
            try:
                submitted = await asyncio.gather(*(self.run_cpu(self._submit, image, queued, abandoned)
                                                   for image in missing.values()))
                rows = await asyncio.gather(*(asyncio.wrap_future(future) for _, future in submitted))
            except BaseException:  # the caller will not use the other images: stop their work
                abandoned.set()
                for future in queued:
                    future.cancel()
                raise
            for key, (pre, _), r in zip(missing, submitted, rows, strict=True):
                found[key] = ImageEmbedding(key, r, tuple(int(v) for v in pre.grid_thw), int(pre.num_tokens),
                                            pre.prompt)
                self.cache.put(key, found[key])
            self.metrics.cache_bytes.set(self.cache.nbytes)
        return [found[key] for key in keys]

    def export_vllm_ec(self, embeddings: Sequence[ImageEmbedding], directory: Path, dtype: torch.dtype) -> list[Path]:
        """Write each image's rows (cast to `dtype`: the consumer's activation dtype, usually bf16)."""
        return [write_ec(directory, e.content_hash, e.rows.to(dtype)) for e in embeddings]

    # -- chats (blocking) -----------------------------------------------------------------------

    def _prompt(self, chat: ChatInput, image_prompts: Sequence[str]) -> list[int]:
        return prompt_ids(self.tokenizer, chat.messages, chat.tools, image_prompts, **chat.kwargs)

    def count_chat_tokens(self, chat: ChatInput) -> ChatTokens:
        """Prompt length after expansion, from image headers only (no pixels decoded)."""
        plans = [self.image_plan(image) for image in chat.images]
        ids = self._prompt(chat, [prompt for prompt, _ in plans])
        counts = [n for _, n in plans]
        return ChatTokens(len(expand_media_pads(ids, counts, self.media_pad_id).input_ids), counts)

    def expanded_prompt(self, chat: ChatInput, embeddings: Sequence[ImageEmbedding]) -> Expanded:
        ids = self._prompt(chat, [e.prompt for e in embeddings])
        return expand_media_pads(ids, [e.num_tokens for e in embeddings], self.media_pad_id)

    @torch.inference_mode()
    def input_embeds(self, expanded: Expanded, embeddings: Sequence[ImageEmbedding]) -> torch.Tensor:
        """The trunk's input rows [T, hidden]: token embeddings with each image span replaced."""
        ids = torch.tensor(expanded.input_ids, dtype=torch.long, device=self.model.device)
        text = self.model.embed_tokens(ids)
        return splice_rows(text, expanded.spans, [e.rows for e in embeddings])

    @torch.inference_mode()
    def generate(self, chat: ChatInput, embeddings: Sequence[ImageEmbedding], params: Any,
                 emit: Callable[[Any], None], cancelled: threading.Event) -> GenerationResult:
        """Prefill the spliced prompt and decode; each parser event goes to `emit` as it happens.

        `params` is a `textcore.generate.SamplingParams`. Stops early (raising GenerationStopped)
        once `cancelled` is set: the check runs after every generated token.
        """
        from textcore.generate import generate
        from textcore.parser import StreamParser
        from textcore.tokenizer import END_OF_MSG_ID

        segments = render(chat.messages, chat.tools, image_prompts=[e.prompt for e in embeddings], **chat.kwargs)
        # The generation prompt ends `<|open|>think<|sep|>` or `<|open|>response<|sep|>`; the parser
        # starts inside that element.
        thinking = len(segments) >= 2 and segments[-2].text == "think"
        ids = self.tokenizer.encode_segments(segments)
        expanded = expand_media_pads(ids, [e.num_tokens for e in embeddings], self.media_pad_id)
        embeds = self.input_embeds(expanded, embeddings)
        parser = StreamParser(self.tokenizer, thinking=thinking)

        def on_token(_: int, token_id: int) -> None:
            if cancelled.is_set():
                raise GenerationStopped
            for event in parser.feed([token_id]):
                emit(event)

        if cancelled.is_set():
            raise GenerationStopped
        (result,) = generate(self.model, inputs_embeds=[embeds], params=params, on_token=on_token,
                             allowed_ids=self._allowed_ids)
        tail = parser.feed([END_OF_MSG_ID]) if result.finish_reason == "stop" else []
        for event in tail + parser.close():
            emit(event)
        return GenerationResult(result.finish_reason, len(expanded.input_ids),
                                sum(e.num_tokens for e in embeddings), len(result.tokens))
