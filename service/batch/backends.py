"""Where a batch job's model work runs: an in-process `Engine`, a bare encoder pool (embedding
jobs need no trunk), or a running server over gRPC. All three answer the same two questions:
`caption(messages, images, max_new_tokens)` and `embed(image)`, and report failures as `Failure`
(permanent: a bad image, recorded and skipped; transient: retried now and again by --resume).

Each backend also names its model (`identity`): the content hash the service gives a fixed probe
image, which covers the checkpoint's identity and the preprocessing options. Local and server
modes compute the same value for the same checkpoint, so a job may be resumed in either mode.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# A 28x28 grey PNG: the probe image whose content hash identifies a model (see module doc).
PROBE_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAIAAAD9b0jDAAAAJ0lEQVR4nGNsaGhgoDZgorqJo4aOGjpq6Kiho4aOGjpq6Kihg9JQAP1uAbgMp"
    "B0oAAAAAElFTkSuQmCC")

# Generation settings a batch job always uses: greedy (reproducible across engines and resumes)
# and no thinking (a caption or a transcription is wanted, not a reasoning trace).
CHAT_KWARGS = {"thinking": False}


class Failure(Exception):
    """One item failed. `transient`: the same request may succeed later (overload, lost worker)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


@dataclass
class Caption:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int  # after image expansion
    image_tokens: int
    completion_tokens: int


@dataclass
class Embedding:
    rows: np.ndarray  # float32 [num_tokens, hidden]
    grid_thw: tuple[int, int, int]
    num_tokens: int


class Backend(Protocol):
    identity: str
    description: str  # for logs: "in-process (cpu:2)", "server 127.0.0.1:50051"

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption: ...

    async def embed(self, image: bytes) -> Embedding: ...

    def cancel_all(self) -> None: ...

    async def close(self) -> None: ...


def local_identity(checkpoint_dir: str | Path) -> str:
    """The model identity of a checkpoint directory, without loading it."""
    from service.embed_cache import checkpoint_identity, content_hash
    from vision import options_key

    return content_hash(PROBE_PNG, options_key(), checkpoint_identity(checkpoint_dir))


def local_failure(exc: BaseException) -> Failure | None:
    """The `Failure` an in-process error stands for; None for errors that are bugs."""
    from service.splice import SpliceError
    from textcore.chat import ChatError
    from vision.errors import ImageError
    from vision.pool import EncodeError, PoolClosedError, WorkerDiedError

    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, ImageError):
        return Failure(f"bad image: {exc}", transient=False)
    if isinstance(exc, ChatError | SpliceError):
        return Failure(f"bad chat: {exc}", transient=False)
    if isinstance(exc, WorkerDiedError):
        return Failure(f"encoder worker died: {exc}", transient=True)
    if isinstance(exc, PoolClosedError):
        return None  # no worker left: the job cannot go on
    if isinstance(exc, EncodeError):
        return Failure(f"encoder failed: {exc}", transient=False)
    if isinstance(exc, ValueError):  # e.g. a grid the tower refuses
        return Failure(str(exc), transient=False)
    return None


class EngineBackend:
    """In-process: the service's `Engine` (tokenizer, trunk, encoder pool) in this process."""

    def __init__(self, engine: Any, *, owns: bool = False) -> None:
        from service.embed_cache import content_hash
        from service.engine import ImageOptions

        self.engine = engine
        self.owns = owns
        self.identity = content_hash(PROBE_PNG, ImageOptions().key(), engine.checkpoint_id)
        self.description = f"in-process ({len(engine.pool.devices)} encoder worker(s): {','.join(engine.pool.devices)})"
        self._cancelled = threading.Event()

    @classmethod
    def load(cls, checkpoint: str | None, devices: str) -> EngineBackend:
        from service.engine import Engine, EngineConfig

        # No embedding cache: a batch job sees each image once.
        return cls(Engine.load(EngineConfig(checkpoint=checkpoint, devices=devices, cache_bytes=0)), owns=True)

    async def embed(self, image: bytes) -> Embedding:
        from service.engine import ImageInput

        try:
            (emb,) = await self.engine.embed_images([ImageInput(image)])
        except Exception as exc:  # noqa: BLE001 - classified; bugs propagate
            raise local_failure(exc) or exc from None
        return Embedding(emb.rows.float().numpy(), tuple(emb.grid_thw), emb.num_tokens)

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption:
        from service.engine import ChatInput, ImageInput
        from textcore.generate import SamplingParams
        from textcore.parser import ContentDelta

        engine = self.engine
        # Named where the chat holds them, as the server names them in its errors.
        where = [f"messages[{i}].content[{k}]" for i, m in enumerate(messages)
                 for k, part in enumerate(m["content"]) if part["type"] == "image"]
        inputs = [ImageInput(data, where=name) for data, name in zip(images, where, strict=True)]
        chat = ChatInput(messages=messages, kwargs=dict(CHAT_KWARGS), images=inputs)
        pieces: list[str] = []

        def emit(event: Any) -> None:  # on the trunk thread
            if isinstance(event, ContentDelta):
                pieces.append(event.text)

        try:
            embeddings = await engine.embed_images(inputs)
            params = SamplingParams(max_new_tokens=max_new_tokens)
            result = await engine.run_trunk(engine.generate, chat, embeddings, params, emit, self._cancelled)
        except Exception as exc:  # noqa: BLE001 - classified; bugs propagate
            raise local_failure(exc) or exc from None
        return Caption("".join(pieces), result.finish_reason, result.prompt_tokens, result.image_tokens,
                       result.completion_tokens)

    def cancel_all(self) -> None:
        self._cancelled.set()  # the trunk thread stops at its next token

    async def close(self) -> None:
        if self.owns:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)


class PoolBackend:
    """In-process, embeddings only: the encoder pool's workers decode, preprocess and encode each
    image, so this process only reads files and writes output (it would otherwise compete with the
    workers for the cores); the trunk is never loaded (for the full model that saves most of the memory)."""

    def __init__(self, pool: Any, checkpoint_dir: str | Path, *, owns: bool = False) -> None:
        from service.engine import EngineConfig
        from vision import Limits

        self.pool = pool
        self.owns = owns
        self.identity = local_identity(checkpoint_dir)
        self.description = f"in-process ({len(pool.devices)} encoder worker(s): {','.join(pool.devices)})"
        defaults = EngineConfig()  # the same per-image limits as the service
        self.limits = Limits(max_bytes=defaults.max_image_bytes, max_pixels=defaults.max_image_pixels)

    @classmethod
    def load(cls, checkpoint: str | None, devices: str) -> PoolBackend:
        from vision.pool import EncoderPool

        if checkpoint is None:
            from service.default_checkpoint import default_checkpoint_dir

            checkpoint = str(default_checkpoint_dir())
        return cls(EncoderPool(checkpoint, devices), checkpoint, owns=True)

    async def embed(self, image: bytes) -> Embedding:
        try:
            # Cheap enough for the event loop: it reads the image header and queues the bytes.
            encoded = await asyncio.wrap_future(self.pool.submit_image(image, limits=self.limits))
        except Exception as exc:  # noqa: BLE001 - classified; bugs propagate
            raise local_failure(exc) or exc from None
        return Embedding(encoded.rows.float().numpy(), encoded.grid_thw, encoded.num_tokens)

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption:
        raise RuntimeError("PoolBackend serves embedding jobs only")

    def cancel_all(self) -> None:
        pass  # queued tower work is short; close() drops it

    async def close(self) -> None:
        if self.owns:
            await asyncio.get_running_loop().run_in_executor(None, self.pool.close)


# gRPC status codes (by name) worth retrying: the server was busy, restarting or lost a worker.
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED", "INTERNAL",
                             "UNKNOWN", "CANCELLED"})


def rpc_failure(exc: BaseException) -> Failure | None:
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        if code.name in TRANSIENT_CODES:
            return Failure(f"server {code.name}: {exc.details()}", transient=True)
        # The server words domain errors as the engine does ("bad image: ..."): the same row either way.
        return Failure(exc.details() or code.name, transient=False)
    return None


class ServerBackend:
    """A running `kimi-vision serve` over gRPC (`AsyncVisionClient`)."""

    def __init__(self, client: Any, target: str, identity: str) -> None:
        self.client = client
        self.identity = identity
        self.description = f"server {target}"

    @classmethod
    async def connect(cls, target: str, *, timeout_s: float = 600.0) -> ServerBackend:
        """Connect, check health, and learn the model identity from one probe `Embed`."""
        from service.client import AsyncVisionClient

        client = AsyncVisionClient(target, timeout=timeout_s)
        try:
            status = await client.health(timeout=10)
            if status != "SERVING":
                raise Failure(f"server {target} is {status} (warming up or draining); retry when it serves",
                              transient=True)
            header, _ = await client.embed(PROBE_PNG, timeout=120)
        except Exception as exc:
            await client.close()
            failure = rpc_failure(exc)
            if failure is not None:
                raise Failure(f"cannot use server {target}: {failure.message}", transient=True) from None
            raise
        return cls(client, target, header.content_hash)

    async def embed(self, image: bytes) -> Embedding:
        try:
            header, rows = await self.client.embed(image, dtype="float32")
        except Exception as exc:  # noqa: BLE001 - classified; bugs propagate
            raise rpc_failure(exc) or exc from None
        return Embedding(np.ascontiguousarray(rows, dtype=np.float32), tuple(header.grid_thw), header.num_tokens)

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption:
        from service._proto import vision_pb2 as pb
        from service.client import message

        remaining = iter(images)
        wire = [message(m["role"], *(p["text"] if p["type"] == "text" else next(remaining) for p in m["content"]))
                for m in messages]
        pieces: list[str] = []
        finish = None
        try:
            async for event in self.client.generate(wire, max_new_tokens=max_new_tokens, chat_kwargs=CHAT_KWARGS):
                kind = event.WhichOneof("event")
                if kind == "content_delta":
                    pieces.append(event.content_delta)
                elif kind == "finish":
                    finish = event.finish
        except Exception as exc:  # noqa: BLE001 - classified; bugs propagate
            raise rpc_failure(exc) or exc from None
        if finish is None:
            raise Failure("server: the stream ended without a finish event", transient=True)
        reason = "stop" if finish.reason == pb.FINISH_REASON_STOP else "length"
        u = finish.usage
        return Caption("".join(pieces), reason, u.prompt_tokens, u.image_tokens, u.completion_tokens)

    def cancel_all(self) -> None:
        pass  # cancelling the calling tasks cancels their RPCs

    async def close(self) -> None:
        await self.client.close()
