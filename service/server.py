"""The gRPC server: `kimi.vision.v1.VisionService` on grpc.aio, plus health, reflection and metrics.

Request flow: an RPC is admitted (bounded: `max_concurrency` hold a slot, up to `max_queue` wait
for one, anything more is `RESOURCE_EXHAUSTED`), its protobuf is checked against the per-request
caps and turned into plain inputs, and the work runs on the `Engine`'s executors and encoder pool
so the event loop only moves bytes. Cancellation (client gone, deadline passed) cancels the
handler task; the engine notices at its next check (queued tower work is dropped, generation
stops at the next token). Every failure goes through `service.errors.status_for`.

Lifecycle: `start()` binds the port and answers health with NOT_SERVING while the engine loads
and warms up in the background; then SERVING. `drain()` (SIGTERM) flips health to NOT_SERVING,
refuses new RPCs with UNAVAILABLE, lets in-flight ones finish (up to a grace period) and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import errors
from service._proto import vision_pb2 as pb
from service._proto import vision_pb2_grpc as pb_grpc
from service.client import MAX_FRAME_BYTES
from service.engine import CHAT_KWARGS, ChatInput, Engine, EngineConfig, ImageEmbedding, ImageInput, ImageOptions
from service.metrics import Metrics
from service.splice import position_ids

log = logging.getLogger("kimi_vision.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VisionService"].full_name
CHUNK_BYTES = 4 << 20  # embedding data chunks (the bound)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (see VisionServer.port)
    metrics_port: int | None = None
    max_receive_bytes: int = 64 << 20  # one request, all images together
    max_send_bytes: int = 256 << 20  # one response (float32 patches of a huge image are ~160 MB)
    max_images: int = 16  # per request
    max_image_bytes: int = 32 << 20  # per image, encoded
    max_request_pixels: int = 200_000_000  # per request, decoded pixels of all images together
    max_concurrency: int = 4  # RPCs doing work at once
    max_queue: int = 32  # RPCs waiting for a slot; more -> RESOURCE_EXHAUSTED
    drain_grace_s: float = 30.0
    ec_export_dir: str | None = None  # where Encode(export_vllm_ec) may write
    # Seams for transport security: TLS credentials (None = plaintext) and interceptors that run
    # before every handler (e.g. authentication), in order.
    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()


# ---------------------------------------------------------------------------------------------
# Admission


class Admission:
    """A bounded queue in front of a fixed number of work slots."""

    def __init__(self, slots: int, queue: int, metrics: Metrics) -> None:
        if slots < 1 or queue < 0:
            raise ValueError("need at least one slot and a non-negative queue")
        self.capacity = slots + queue
        self._slots = asyncio.Semaphore(slots)
        self._metrics = metrics
        self.admitted = 0  # waiting + working
        self.working = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.admitted >= self.capacity:
            raise errors.Overloaded(f"server is at capacity ({self.capacity} requests admitted); retry with backoff")
        self.admitted += 1
        self._metrics.queue_depth.inc()
        try:
            try:
                await self._slots.acquire()
            finally:
                self._metrics.queue_depth.dec()
            self.working += 1
            self._metrics.inflight.inc()
            try:
                yield
            finally:
                self.working -= 1
                self._metrics.inflight.dec()
                self._slots.release()
        finally:
            self.admitted -= 1


# ---------------------------------------------------------------------------------------------
# Request conversion (protobuf -> engine inputs), with the per-request caps


def _json_field(text: str, name: str, kind: type) -> Any:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.BadRequest(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise errors.BadRequest(f"{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


class _Images:
    """Collects a request's images, enforcing the count and byte caps."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.items: list[ImageInput] = []

    def add(self, image: pb.Image, where: str = "") -> ImageInput:
        """`where` locates the image in a chat (empty for the single-image RPCs)."""
        cfg = self.config
        label = where or "image"
        if len(self.items) >= cfg.max_images:
            raise errors.BadRequest(f"too many images: this server takes at most {cfg.max_images} per request")
        mime = image.mime_type.strip().lower()
        if mime.startswith("video/"):
            raise errors.Unsupported(f"{label}: video ({mime}) is not supported; Kimi-K3 takes images only")
        if mime and not mime.startswith("image/"):
            raise errors.Unsupported(f"{label}: media type {mime!r} is not supported; send an image")
        data = image.data  # each read of a bytes field copies it out of the message
        if not data:
            raise errors.BadRequest(f"{label}: image data is empty")
        if len(data) > cfg.max_image_bytes:
            raise errors.BadRequest(f"{label}: image is {len(data)} bytes; the limit is {cfg.max_image_bytes}")
        resize = image.options.resize or "exact"
        if resize not in ("exact", "fast"):
            raise errors.BadRequest(f"{label}: options.resize must be 'exact' or 'fast', got {resize!r}")
        options = ImageOptions(exif_transpose=image.options.exif_transpose,
                               max_tokens=image.options.max_tokens or None, resize=resize)
        item = ImageInput(data=data, options=options, where=where)
        self.items.append(item)
        return item


def _chat(messages: Sequence[pb.ChatMessage], tools_json: str, thinking_effort: str, chat_kwargs_json: str,
          config: ServerConfig, *, generation: bool) -> ChatInput:
    """The chat as the template's dicts, with each image part in order."""
    if not messages:
        raise errors.BadRequest("messages is empty")
    images = _Images(config)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role}
        parts: list[dict[str, Any]] = []
        for k, part in enumerate(m.content):
            which = part.WhichOneof("part")
            if which == "text":
                parts.append({"type": "text", "text": part.text})
            elif which == "image":
                images.add(part.image, f"messages[{i}].content[{k}]")
                parts.append({"type": "image"})
            else:
                raise errors.BadRequest(f"messages[{i}].content[{k}] is neither text nor image")
        d["content"] = parts
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json}} for c in m.tool_calls]
        out.append(d)
    tools = _json_field(tools_json, "tools_json", list)
    kwargs = _json_field(chat_kwargs_json, "chat_kwargs_json", dict) or {}
    unknown = sorted(set(kwargs) - set(CHAT_KWARGS))
    if unknown:
        raise errors.BadRequest(f"chat_kwargs_json has unknown keys {unknown}; allowed: {sorted(CHAT_KWARGS)}")
    if generation and kwargs.get("add_generation_prompt") is False:
        raise errors.BadRequest("Generate always adds the generation prompt; drop add_generation_prompt")
    if thinking_effort == "medium":
        kwargs["thinking_effort"] = None  # named by the template's message, but it injects nothing
    elif thinking_effort:
        kwargs["thinking_effort"] = thinking_effort
    return ChatInput(messages=out, tools=tools, kwargs=kwargs, images=images.items)


def _check_pixels(sizes: Sequence[tuple[int, int]], config: ServerConfig) -> None:
    total = sum(w * h for w, h in sizes)
    if total > config.max_request_pixels:
        raise errors.BadRequest(f"the request's images hold {total} pixels; the limit is {config.max_request_pixels}")


def _tensor_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """Raw little-endian row-major bytes of `t` cast to `dtype` (bfloat16 as its 16-bit words)."""
    t = t.detach().to("cpu", _TORCH_DTYPES[dtype]).contiguous()
    if dtype == "bfloat16":
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _pixels_tensor(pre: Any, patches: bool) -> pb.Tensor:
    """The model input as a Tensor: float32 patches [N, 3, 14, 14] (built here, on first use) or the
    padded uint8 image [H, W, 3]."""
    array, dtype = (pre.pixel_values, "float32") if patches else (pre.image, "uint8")
    little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=little_endian.tobytes())


def _out_dtype(name: str) -> str:
    name = name or "float32"
    if name not in _TORCH_DTYPES:
        raise errors.BadRequest(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {name!r}")
    return name


def _chunks(data: bytes) -> list[memoryview]:
    view = memoryview(data)
    return [view[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


# ---------------------------------------------------------------------------------------------
# The service


class VisionService(pb_grpc.VisionServiceServicer):
    def __init__(self, server: VisionServer) -> None:
        self._server = server

    @property
    def _engine(self) -> Engine:
        return self._server.engine

    @property
    def _config(self) -> ServerConfig:
        return self._server.config

    async def _embed(self, images: Sequence[ImageInput]) -> list[ImageEmbedding]:
        engine = self._engine
        if len(images) > 1:  # one image is bounded by the engine's per-image limits alone
            _check_pixels(await engine.run_cpu(engine.image_sizes, images), self._config)
        return await engine.embed_images(images)

    # -- unary --------------------------------------------------------------------------------

    async def Preprocess(self, request: pb.PreprocessRequest,
                         context: grpc.aio.ServicerContext) -> pb.PreprocessResponse:
        async with self._server.call("Preprocess", context):
            image = _Images(self._config).add(request.image)
            engine = self._engine
            pre = await engine.run_cpu(engine.preprocess, image)
            reply = pb.PreprocessResponse(
                orig_width=pre.orig_size[0], orig_height=pre.orig_size[1], width=pre.size[0], height=pre.size[1],
                padded_width=pre.padded_size[0], padded_height=pre.padded_size[1], grid_thw=list(pre.grid_thw),
                num_tokens=pre.num_tokens, prompt=pre.prompt,
            )
            if request.return_pixels:
                patches = request.pixel_format == pb.PreprocessRequest.PIXEL_FORMAT_FLOAT32_PATCHES
                reply.pixel_values.CopyFrom(await engine.run_cpu(_pixels_tensor, pre, patches))
            self._server.metrics.tokens.labels(kind="image").inc(pre.num_tokens)
            return reply

    async def CountTokens(self, request: pb.CountTokensRequest,
                          context: grpc.aio.ServicerContext) -> pb.CountTokensResponse:
        async with self._server.call("CountTokens", context):
            engine = self._engine
            which = request.WhichOneof("input")
            if which == "image":
                image = _Images(self._config).add(request.image)
                n = await engine.run_cpu(engine.count_image_tokens, image)
                return pb.CountTokensResponse(num_tokens=n, image_tokens=[n])
            if which == "chat":
                c = request.chat
                chat = _chat(c.messages, c.tools_json, c.thinking_effort, c.chat_kwargs_json, self._config,
                             generation=False)
                counts = await engine.run_cpu(engine.count_chat_tokens, chat)
                return pb.CountTokensResponse(num_tokens=counts.total, image_tokens=counts.image_tokens,
                                              text_tokens=counts.total - sum(counts.image_tokens))
            raise errors.BadRequest("CountTokens needs an image or a chat")

    # -- streams ------------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EmbedChunk]:
        async with self._server.call("Embed", context):
            dtype = _out_dtype(request.dtype)
            image = _Images(self._config).add(request.image)
            (emb,) = await self._embed([image])
            data = await self._engine.run_cpu(_tensor_bytes, emb.rows, dtype)
            header = pb.EmbedHeader(
                num_tokens=emb.num_tokens, hidden_size=emb.rows.shape[1], dtype=dtype, shape=list(emb.rows.shape),
                grid_thw=list(emb.grid_thw), prompt=emb.prompt, content_hash=emb.content_hash, nbytes=len(data),
                cached=emb.cached,
            )
            self._server.metrics.tokens.labels(kind="image").inc(emb.num_tokens)
            yield pb.EmbedChunk(header=header)
            for piece in _chunks(data):
                yield pb.EmbedChunk(data=bytes(piece))

    async def Encode(self, request: pb.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EncodeChunk]:
        async with self._server.call("Encode", context):
            dtype = _out_dtype(request.dtype)
            export_dir = self._config.ec_export_dir
            if request.export_vllm_ec and not export_dir:
                raise errors.NotConfigured("export_vllm_ec needs the server to run with --ec-export-dir")
            chat = _chat(request.messages, request.tools_json, request.thinking_effort, request.chat_kwargs_json,
                         self._config, generation=False)
            embeddings = await self._embed(chat.images)
            engine = self._engine
            expanded = await engine.run_cpu(engine.expanded_prompt, chat, embeddings)
            ec_paths = [""] * len(embeddings)
            if request.export_vllm_ec:
                written = await engine.run_cpu(engine.export_vllm_ec, embeddings, Path(export_dir),
                                               _TORCH_DTYPES[dtype])
                ec_paths = [str(p) for p in written]
            rows = [e.rows for e in embeddings]
            data = b"".join([await engine.run_cpu(_tensor_bytes, r, dtype) for r in rows])
            positions = position_ids(torch.ones(len(expanded.input_ids), dtype=torch.long))
            header = pb.EncodeHeader(
                input_ids=expanded.input_ids, position_ids=positions.tolist(), hidden_size=engine.hidden_size,
                dtype=dtype, num_rows=sum(e.num_tokens for e in embeddings), nbytes=len(data),
                media_pad_id=engine.media_pad_id,
                spans=[pb.ImageSpan(offset=s.offset, length=s.length, content_hash=e.content_hash,
                                    grid_thw=list(e.grid_thw), ec_path=p)
                       for s, e, p in zip(expanded.spans, embeddings, ec_paths, strict=True)],
            )
            metrics = self._server.metrics
            metrics.tokens.labels(kind="image").inc(header.num_rows)
            metrics.tokens.labels(kind="prompt").inc(len(expanded.input_ids))
            yield pb.EncodeChunk(header=header)
            for piece in _chunks(data):
                yield pb.EncodeChunk(data=bytes(piece))

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:
        async with self._server.call("Generate", context) as cancelled:
            engine = self._engine
            chat = _chat(request.messages, request.tools_json, request.thinking_effort, request.chat_kwargs_json,
                         self._config, generation=True)
            params = _sampling(request, engine.config)
            embeddings = await self._embed(chat.images)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def emit(event: Any) -> None:  # on the trunk thread
                loop.call_soon_threadsafe(events.put_nowait, event)

            def finished(job: asyncio.Future) -> None:
                events.put_nowait(None)
                if not job.cancelled():
                    job.exception()  # retrieved here too: when the RPC is gone nobody awaits it

            job = asyncio.ensure_future(engine.run_trunk(engine.generate, chat, embeddings, params, emit, cancelled))
            job.add_done_callback(finished)
            try:
                while (event := await events.get()) is not None:
                    message = _event(event)
                    if message is not None:
                        yield message
                result = await job
            finally:
                cancelled.set()  # the trunk thread stops at its next token if we are leaving early
            metrics = self._server.metrics
            metrics.tokens.labels(kind="prompt").inc(result.prompt_tokens)
            metrics.tokens.labels(kind="image").inc(result.image_tokens)
            metrics.tokens.labels(kind="generated").inc(result.completion_tokens)
            yield pb.GenerateEvent(finish=pb.Finish(
                reason=_FINISH[result.finish_reason],
                usage=pb.Usage(prompt_tokens=result.prompt_tokens, image_tokens=result.image_tokens,
                               completion_tokens=result.completion_tokens)))


def _sampling(request: pb.GenerateRequest, config: EngineConfig) -> Any:
    from textcore.generate import SamplingParams

    max_new = request.max_new_tokens or config.default_max_new_tokens
    if max_new > config.max_new_tokens_limit:
        raise errors.BadRequest(f"max_new_tokens {max_new} is above this server's limit {config.max_new_tokens_limit}")
    s = request.sampling
    if not s.temperature >= 0 or not 0 <= s.top_p <= 1:
        raise errors.BadRequest(f"sampling needs temperature >= 0 and 0 <= top_p <= 1 (got {s.temperature}, {s.top_p})")
    return SamplingParams(max_new_tokens=max_new, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                          seed=s.seed if s.HasField("seed") else None)


def _event(event: Any) -> pb.GenerateEvent | None:
    """A textcore parser event as a GenerateEvent (None for events the wire does not carry)."""
    from textcore import parser as p

    if isinstance(event, p.ReasoningDelta):
        return pb.GenerateEvent(reasoning_delta=event.text)
    if isinstance(event, p.ContentDelta):
        return pb.GenerateEvent(content_delta=event.text)
    if isinstance(event, p.ToolCallStart):
        return pb.GenerateEvent(tool_call_start=pb.ToolCallStart(index=event.index, name=event.name))
    if isinstance(event, p.ToolArgumentDelta):
        return pb.GenerateEvent(argument_delta=pb.ToolArgumentDelta(
            index=event.index, key=event.key or "", type=event.type, text=event.text))
    if isinstance(event, p.ToolArgumentError):
        return pb.GenerateEvent(argument_error=pb.ToolArgumentError(
            index=event.index, key=event.key or "", type=event.type, message=event.message, raw=event.raw))
    if isinstance(event, p.ToolCallEnd):
        return pb.GenerateEvent(tool_call_end=pb.ToolCallEnd(
            index=event.index, name=event.name, arguments_json=json.dumps(event.arguments, ensure_ascii=False)))
    if isinstance(event, p.ProtocolError):
        return pb.GenerateEvent(protocol_error=event.message)
    return None  # ToolArgumentDone (carried by ToolCallEnd), Stop (carried by Finish)


# ---------------------------------------------------------------------------------------------
# Server lifecycle


class VisionServer:
    """One grpc.aio server around one `Engine`. Create and use it on a running event loop."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig | None = None, *,
                 engine: Engine | None = None, metrics: Metrics | None = None) -> None:
        if (engine_config is None) == (engine is None):
            raise ValueError("give either engine_config (the server loads it) or a loaded engine")
        self.config = config
        self.engine_config = engine_config
        self.engine: Engine | None = engine
        self._owns_engine = engine is None
        self.metrics = metrics or Metrics()
        self.admission = Admission(config.max_concurrency, config.max_queue, self.metrics)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.ready = asyncio.Event()
        self.draining = False
        self.load_error: BaseException | None = None
        self._server: grpc.aio.Server | None = None
        self._warm_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    # -- per-RPC wrapper ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def call(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[threading.Event]:
        """Admission, metrics and the error mapping around one RPC's body.

        Yields a `threading.Event` that is set when the RPC is cancelled or ends, which the
        engine's blocking work polls to stop early.
        """
        start = time.perf_counter()
        cancelled = threading.Event()
        code = grpc.StatusCode.OK
        try:
            if self.draining:
                raise errors.Unavailable("server is draining; retry on another instance")
            if self.load_error is not None:
                raise errors.Unavailable("server failed to load its model (see the server log); use another instance")
            if not self.ready.is_set():
                raise errors.Unavailable("server is warming up; retry shortly")
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise errors.DeadlineExceeded("deadline already passed")
            async with self.admission.slot():
                yield cancelled
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            deadline_hit = remaining is not None and remaining < 0.05  # gRPC cancels at the deadline
            code = grpc.StatusCode.DEADLINE_EXCEEDED if deadline_hit else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, in one place
            code, message = errors.status_for(exc)
            await context.abort(code, message)
        finally:
            cancelled.set()
            self.metrics.observe(method, code.name, time.perf_counter() - start)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until the engine is warm). Returns the port."""
        cfg = self.config
        server = grpc.aio.server(interceptors=cfg.interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_receive_bytes),
            ("grpc.max_send_message_length", cfg.max_send_bytes),
            ("grpc.so_reuseport", 0),  # a busy port is an error, not silently shared
            # A multi-MB image in 4 MiB HTTP/2 frames rather than 16 KiB ones (measured: a 2.5 MB
            # request in about half the time on loopback). Keep in step with service.client.
            ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
        ])
        pb_grpc.add_VisionServiceServicer_to_server(VisionService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        try:
            self.port = (server.add_secure_port(address, cfg.credentials) if cfg.credentials
                         else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from None
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            self.metrics.serve_http(cfg.metrics_port, addr=cfg.host)
        self._warm_task = asyncio.create_task(self._warm())
        return self.port

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _warm(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.engine is None:
                self.engine = await loop.run_in_executor(None, Engine.load, self.engine_config, self.metrics)
            await loop.run_in_executor(None, self.engine.warmup)
        except Exception as exc:  # noqa: BLE001 - reported by wait_ready / serve
            self.load_error = exc
            log.error("engine failed to load: %s", exc)
            self._stopped.set()
            return
        if not self.draining:
            self.ready.set()
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            log.info("serving %s on %s:%s", SERVICE_NAME, self.config.host, self.port)
            self._watch_task = asyncio.create_task(self._watch_pool())

    async def _watch_pool(self, period_s: float = 1.0) -> None:
        """Health follows the encoder pool: NOT_SERVING while no worker is ready (e.g. the only one
        died and is restarting), SERVING again once one is."""
        serving = True
        while not self.draining:
            await asyncio.sleep(period_s)
            now = bool(self.engine.pool.health()["serving"])
            if now != serving and not self.draining:
                serving = now
                log.warning("encoder pool %s", "ready again" if now else "has no ready worker")
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if now
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until warm; raises the load error if the engine could not be loaded."""
        await asyncio.wait_for(asyncio.shield(self._warm_task), timeout)
        if self.load_error is not None:
            raise self.load_error

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop taking work, let in-flight RPCs finish (up to the grace period), then stop."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        log.info("draining: health NOT_SERVING, new requests refused, %d in flight, grace %.0f s",
                 self.admission.admitted, grace)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace
        while self.admission.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop(grace=max(0.0, deadline - time.monotonic()))

    async def stop(self, grace: float | None = 0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
        for task in (self._warm_task, self._watch_task):
            if task is not None and not task.done():
                task.cancel()
        if self._owns_engine and self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
            self.engine = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig, engine_config: EngineConfig,
                on_ready: Callable[[VisionServer], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT (which drain). Returns the process exit code."""
    server = VisionServer(config, engine_config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    try:
        await server.wait_ready()
    except Exception as exc:  # noqa: BLE001 - a clear message, not a traceback
        log.error("cannot serve: %s", exc)
        await server.stop()
        return 1
    if on_ready is not None:
        on_ready(server)
    await server.wait_stopped()
    return 0


class ServerThread:
    """A `VisionServer` on its own event loop in a background thread (demo, tests, benchmarks).

        with ServerThread(ServerConfig(port=0), EngineConfig()) as handle:
            client = VisionClient(handle.target)
    """

    def __init__(self, config: ServerConfig, engine_config: EngineConfig | None = None, *,
                 engine: Engine | None = None, ready_timeout_s: float = 600.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kimi-vision-server", daemon=True)
        self._thread.start()
        self._ready_timeout_s = ready_timeout_s

        async def build() -> VisionServer:
            return VisionServer(config, engine_config, engine=engine)

        self.server: VisionServer = self._run(build())
        self.port: int = self._run(self.server.start())

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"{self.server.config.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def wait_ready(self) -> ServerThread:
        self._run(self.server.wait_ready(self._ready_timeout_s))
        return self

    def drain(self, grace_s: float | None = None) -> None:
        self._run(self.server.drain(grace_s))

    def drain_in_background(self, grace_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace_s), self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self._run(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
