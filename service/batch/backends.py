"""Where a batch job's model work runs: in this process (`EngineBackend`, the engine) or on a
running server over gRPC (`ServerBackend`). Both answer the same questions, `generate(chat,
media, params)` (a `service.openai.response.Reply`) and `embed(image)`, raise failures
with a kind of the service's taxonomy (the runner classifies them with `service.errors.classify`),
name their model the same way (`identity`: the checkpoint fingerprint, so a job may be resumed in
either mode; `serves(model)` and `model_name`, the first served name, as vLLM names it in replies)
and say what an image may be (`limits`: the engine's, or those the server reports; the runner reads
images under them). A request a server could not receive (over its message limit) is refused here,
too large, before it is sent.
The Ray engine runs an `EngineBackend` inside each of its actors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from service.auth import ENV_VAR
from service.engine import (
    ChatInput,
    Choice,
    Engine,
    EngineConfig,
    GenerationResult,
    Logprobs,
    MediaInput,
    SamplingParams,
    TokenLogprob,
)
from service.errors import (
    KIND_METADATA,
    BadRequest,
    Kind,
    RemoteError,
    ServiceError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    Unsupported,
)
from service.openai.response import Reply
from service.rpc._proto import vision_pb2 as pb
from service.rpc.auth import bearer_credentials
from service.rpc.client import DEFAULT_MAX_SEND_BYTES, AsyncVisionClient, embed_request, generate_request
from textcore import parser as p
from vision import DEFAULT_LIMITS, Limits, check_modality

# What a chat message may hold that a server's Generate carries (the in-process engine reads the
# message as it is).
WIRE_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content",
                                 "reasoning"})


@dataclass
class Embedding:
    rows: np.ndarray  # float32 [num_tokens, hidden]
    grid_thw: tuple[int, int, int]
    num_tokens: int


class Backend(Protocol):
    identity: str  # the checkpoint fingerprint of the model that answers
    description: str  # for logs: "in-process (cpu:2)", "server 127.0.0.1:50051"
    model_name: str  # the model a reply names
    limits: Limits  # what an image may be (its encoded bytes are checked as it is read)

    def serves(self, model: str | None) -> bool: ...

    async def generate(self, chat: ChatInput, media: list[MediaInput], params: SamplingParams) -> Reply: ...

    async def embed(self, image: bytes) -> Embedding: ...

    async def close(self) -> None: ...


class EngineBackend:
    """In-process: the service's `Engine` in this process (for an embedding job, with only the
    vision components: the trunk is never loaded)."""

    def __init__(self, engine: Engine, *, owns: bool = False) -> None:
        self.engine = engine
        self.owns = owns
        self.identity = engine.fingerprint
        self.model_name = engine.served_model_names[0]
        self.limits = engine.config.limits
        self.description = f"in-process ({len(engine.devices)} encoder worker(s): {','.join(engine.devices)})"

    @classmethod
    def load(cls, checkpoint: Path, devices: str, *, trunk: bool, limits: Limits = DEFAULT_LIMITS) -> EngineBackend:
        # No embedding cache: a batch job sees each image once.
        config = EngineConfig(checkpoint=checkpoint, devices=devices, components="all" if trunk else "vision",
                              cache_bytes=0, limits=limits)
        return cls(Engine.load(config), owns=True)

    def serves(self, model: str | None) -> bool:
        return self.engine.serves(model)

    async def embed(self, image: bytes) -> Embedding:
        (emb,) = await self.engine.embed([MediaInput(image)])
        return Embedding(emb.rows.float().numpy(), emb.grid_thw, emb.num_tokens)

    async def generate(self, chat: ChatInput, media: list[MediaInput], params: SamplingParams) -> Reply:
        engine = self.engine
        prepared = await engine.prepare(engine.check(media, chat, params), media, chat)
        reply = Reply()
        async with contextlib.aclosing(engine.generate(prepared)) as items:
            async for item in items:
                reply.add(item)
        return reply

    async def close(self) -> None:
        if self.owns:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)


@contextlib.contextmanager
def _remote_errors():
    """A failed RPC as the failure the server reported (the kind it names, else its status code's)."""
    try:
        yield
    except grpc.RpcError as exc:
        if not hasattr(exc, "code"):
            raise
        metadata = dict(exc.trailing_metadata() or ())
        raise RemoteError(exc.code(), exc.details() or "", kind=metadata.get(KIND_METADATA)) from None


class ServerBackend:
    """A running `kimi-vision serve` over gRPC (`AsyncVisionClient`). Its limits are those the
    server reports (a server older than those fields: the defaults, which it then had)."""

    def __init__(self, client: AsyncVisionClient, target: str, info: pb.ModelInfo) -> None:
        self.client = client
        self.identity = info.fingerprint
        self.served_model_names = tuple(info.served_model_names) or (info.model_id,)
        self.model_name = self.served_model_names[0]
        self.limits = Limits(max_bytes=info.max_image_bytes or DEFAULT_LIMITS.max_bytes,
                             max_pixels=info.max_image_pixels or DEFAULT_LIMITS.max_pixels)
        self.max_message_bytes = info.max_message_bytes or DEFAULT_MAX_SEND_BYTES
        self.description = f"server {target}"

    @classmethod
    async def connect(cls, target: str, *, timeout_s: float = 600.0, token: str | None = None) -> ServerBackend:
        """Connect, check health, and learn the model and its limits (`GetModelInfo`). `token`:
        sent on every call (over gRPC's local credentials: the server must be on this machine)."""
        # No send limit on the channel: the server's own (`max_message_bytes`) is checked before each send.
        credentials = bearer_credentials(token) if token else None
        client = AsyncVisionClient(target, timeout=timeout_s, max_send_bytes=-1, credentials=credentials)
        try:
            with _remote_errors():
                status = await client.health(timeout=10)
                if status != "SERVING":
                    raise Unavailable(f"server {target} is {status} (warming up or draining); retry when it serves")
                info = await client.model_info(timeout=60)
        except ServiceError as exc:
            await client.close()
            if exc.kind == Kind.UNAUTHENTICATED:
                raise Unauthenticated(f"server {target} refused the job: {exc} (the token comes from --auth-token or "
                                      f"${ENV_VAR})") from None
            raise Unavailable(f"cannot use server {target}: {exc}") from None
        except BaseException:
            await client.close()
            raise
        return cls(client, target, info)

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.served_model_names

    def _check_size(self, request: Any) -> None:
        size = request.ByteSize()
        if size > self.max_message_bytes:
            raise TooLarge(f"the request is {size:,} bytes, over the server's message limit of "
                           f"{self.max_message_bytes:,} bytes (its --max-message-mb), which holds all of a "
                           "request's images and the rest of the message")

    async def embed(self, image: bytes) -> Embedding:
        request = embed_request(pb.Image(data=image), dtype="float32")
        self._check_size(request)
        with _remote_errors():
            header, rows = await self.client.send_embed(request)
        return Embedding(np.ascontiguousarray(rows, dtype=np.float32), tuple(header.grid_thw), header.num_tokens)

    async def generate(self, chat: ChatInput, media: list[MediaInput], params: SamplingParams) -> Reply:
        request = generate_request(wire_messages(chat, media), chat.tools, "", params.max_new_tokens,
                                   wire_sampling(params), chat.kwargs)
        self._check_size(request)
        reply = Reply()
        with _remote_errors():
            async for event in self.client.send_generate(request):
                item = _engine_item(event)
                if item is not None:
                    reply.add(item)
        if not reply.finished:
            raise Unavailable("server: the stream ended without a finish event")
        return reply

    async def close(self) -> None:
        await self.client.close()


def _engine_item(event: pb.GenerateEvent) -> Choice | None:
    """A GenerateEvent as the engine item it carries (the reverse of `service.rpc.convert.event`,
    for the items a `Reply` reads)."""
    item = _item(event)
    return None if item is None else Choice(event.index, item)


def _item(event: pb.GenerateEvent) -> p.Event | Logprobs | GenerationResult | None:
    kind = event.WhichOneof("event")
    if kind == "content_delta":
        return p.ContentDelta(event.content_delta)
    if kind == "reasoning_delta":
        return p.ReasoningDelta(event.reasoning_delta)
    if kind == "tool_call_end":
        end = event.tool_call_end
        return p.ToolCallEnd(end.index, end.name, json.loads(end.arguments_json))
    if kind == "logprobs":
        chosen, top = event.logprobs.chosen, event.logprobs.top
        wire_bytes = {e.token_id: e.bytes for e in (chosen, *top)}  # the server read each token's bytes
        return Logprobs(TokenLogprob(chosen.token_id, chosen.logprob),
                        tuple(TokenLogprob(e.token_id, e.logprob) for e in top), wire_bytes.__getitem__)
    if kind == "finish":
        finish, usage = event.finish, event.finish.usage
        reason = "stop" if finish.reason == pb.FINISH_REASON_STOP else "length"
        return GenerationResult(reason, usage.prompt_tokens, usage.image_tokens, usage.completion_tokens)
    return None


def wire_sampling(params: SamplingParams) -> dict[str, Any]:
    """`params` as the `Sampling` message's fields (the reverse of `service.rpc.convert.sampling`)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "max_new_tokens"}
    return {name: value for name, value in fields.items() if value is not None}


def wire_messages(chat: ChatInput, media: list[MediaInput]) -> list[pb.ChatMessage]:
    """The chat's messages as Generate carries them (each media part takes the next item)."""
    images = iter(media)
    out = []
    for i, message in enumerate(chat.messages):
        where = f"messages[{i}]"
        extra = sorted(set(message) - WIRE_MESSAGE_FIELDS)
        if extra:
            raise Unsupported(f"{where} has field(s) {extra} that a server's Generate does not carry; run this job "
                              "in-process (without --server)")
        content = message.get("content")
        if isinstance(content, str):
            parts = [pb.ContentPart(text=content)]
        else:
            parts = [pb.ContentPart(image=_wire_image(next(images))) if part["type"] == "image"
                     else pb.ContentPart(text=part["text"]) for part in content or []]
        out.append(pb.ChatMessage(
            role=message["role"], content=parts, name=_text(message, "name", where),
            tool_call_id=_text(message, "tool_call_id", where),
            tool_calls=[_wire_call(call, f"{where}.tool_calls[{k}]") for k, call in
                        enumerate(message.get("tool_calls") or [])],
            reasoning_content=_text(message, "reasoning_content", where) or _text(message, "reasoning", where)))
    return out


def _wire_image(image: MediaInput) -> pb.Image:
    check_modality(image.modality, image.where)  # the wire carries images: refused here as the server would
    return pb.Image(data=image.data, uuid=image.uuid or "")


def _text(message: Mapping[str, Any], key: str, where: str) -> str:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string, got {type(value).__name__}")
    return value or ""


def _wire_call(call: Any, where: str) -> pb.ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                         "'arguments': ...}}}")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return pb.ToolCall(id=str(call.get("id") or ""), name=function["name"], arguments_json=arguments or "")
