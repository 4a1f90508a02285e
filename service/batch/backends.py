"""Where a batch job's model work runs: in this process (`EngineBackend`, the engine) or on a
running server over gRPC (`ServerBackend`). Both answer the same two questions,
`caption(messages, images, max_new_tokens)` and `embed(image)`, raise failures with a kind of the
service's taxonomy (the runner classifies them with `service.errors.classify`), and name their
model (`identity`: the checkpoint fingerprint, the same in both, so a job may be resumed in either
mode). The Ray engine runs an `EngineBackend` inside each of its actors.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from service.engine import ChatInput, Engine, EngineConfig, GenerationResult, ImageInput
from service.errors import RemoteError, ServiceError, Unavailable
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import AsyncVisionClient, message
from textcore.parser import ContentDelta

# Generation settings a batch job always uses: no thinking (a caption or a transcription is
# wanted, not a reasoning trace); greedy sampling (reproducible across engines and resumes).
CHAT_KWARGS = {"thinking": False}


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
    identity: str  # the checkpoint fingerprint of the model that answers
    description: str  # for logs: "in-process (cpu:2)", "server 127.0.0.1:50051"

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption: ...

    async def embed(self, image: bytes) -> Embedding: ...

    async def close(self) -> None: ...


class EngineBackend:
    """In-process: the service's `Engine` in this process (for an embedding job, with only the
    vision components: the trunk is never loaded)."""

    def __init__(self, engine: Engine, *, owns: bool = False) -> None:
        self.engine = engine
        self.owns = owns
        self.identity = engine.fingerprint
        self.description = f"in-process ({len(engine.devices)} encoder worker(s): {','.join(engine.devices)})"

    @classmethod
    def load(cls, checkpoint: Path, devices: str, *, trunk: bool) -> EngineBackend:
        # No embedding cache: a batch job sees each image once.
        config = EngineConfig(checkpoint=checkpoint, devices=devices, components="all" if trunk else "vision",
                              cache_bytes=0)
        return cls(Engine.load(config), owns=True)

    async def embed(self, image: bytes) -> Embedding:
        (emb,) = await self.engine.embed([ImageInput(image)])
        return Embedding(emb.rows.float().numpy(), emb.grid_thw, emb.num_tokens)

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption:
        engine = self.engine
        chat = ChatInput(messages=messages, kwargs=dict(CHAT_KWARGS), images=[ImageInput(data) for data in images])
        pieces: list[str] = []
        async with contextlib.aclosing(engine.generate(chat, engine.sampling(max_new_tokens))) as items:
            async for item in items:
                if isinstance(item, ContentDelta):
                    pieces.append(item.text)
                elif isinstance(item, GenerationResult):
                    result = item
        return Caption("".join(pieces), result.finish_reason, result.prompt_tokens, result.image_tokens,
                       result.completion_tokens)

    async def close(self) -> None:
        if self.owns:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)


@contextlib.contextmanager
def _remote_errors():
    """A failed RPC as the failure the server reported (its status code gives the kind)."""
    try:
        yield
    except grpc.RpcError as exc:
        if not hasattr(exc, "code"):
            raise
        raise RemoteError(exc.code(), exc.details() or "") from None


class ServerBackend:
    """A running `kimi-vision serve` over gRPC (`AsyncVisionClient`)."""

    def __init__(self, client: AsyncVisionClient, target: str, identity: str) -> None:
        self.client = client
        self.identity = identity
        self.description = f"server {target}"

    @classmethod
    async def connect(cls, target: str, *, timeout_s: float = 600.0) -> ServerBackend:
        """Connect, check health, and learn the model identity (`GetModelInfo`)."""
        client = AsyncVisionClient(target, timeout=timeout_s)
        try:
            with _remote_errors():
                status = await client.health(timeout=10)
                if status != "SERVING":
                    raise Unavailable(f"server {target} is {status} (warming up or draining); retry when it serves")
                info = await client.model_info(timeout=60)
        except ServiceError as exc:
            await client.close()
            raise Unavailable(f"cannot use server {target}: {exc}") from None
        except BaseException:
            await client.close()
            raise
        return cls(client, target, info.fingerprint)

    async def embed(self, image: bytes) -> Embedding:
        with _remote_errors():
            header, rows = await self.client.embed(image, dtype="float32")
        return Embedding(np.ascontiguousarray(rows, dtype=np.float32), tuple(header.grid_thw), header.num_tokens)

    async def caption(self, messages: list[dict[str, Any]], images: list[bytes], max_new_tokens: int) -> Caption:
        remaining = iter(images)
        wire = [message(m["role"], *(p["text"] if p["type"] == "text" else next(remaining) for p in m["content"]))
                for m in messages]
        pieces: list[str] = []
        finish = None
        with _remote_errors():
            async for event in self.client.generate(wire, max_new_tokens=max_new_tokens, chat_kwargs=CHAT_KWARGS):
                kind = event.WhichOneof("event")
                if kind == "content_delta":
                    pieces.append(event.content_delta)
                elif kind == "finish":
                    finish = event.finish
        if finish is None:
            raise Unavailable("server: the stream ended without a finish event")
        reason = "stop" if finish.reason == pb.FINISH_REASON_STOP else "length"
        u = finish.usage
        return Caption("".join(pieces), reason, u.prompt_tokens, u.image_tokens, u.completion_tokens)

    async def close(self) -> None:
        await self.client.close()
