"""The OpenAI-compatible HTTP face (FastAPI): what vLLM's disaggregated-encoder proxy and OpenAI
clients call, on the same engine, admission, limits, token and metrics as the gRPC face.

- `POST /v1/chat/completions`: a chat with images (`data:` URLs; `http(s)` ones only with
  `--allow-remote-images`) through the trunk, streamed as server-sent events with `stream: true`.
  In EC producer mode (`--ec-role producer`) every request is an encode request, whatever its
  `max_tokens` (every vLLM chat parameter is taken: nothing is sampled): its images are encoded and
  written under the key vLLM looks each up by, and the answer is a `chat.completion` (or one SSE
  chunk and `[DONE]`) with no completion tokens, carrying `ec_transfer_params` as vLLM's producer
  reports them (per key: the item positions and the placeholder metadata), without the trunk.
- SGLang's encoder protocol (`sglang.py`): `POST /encode`, `/scheduler_receive_url`, `GET /health_generate`.
- `GET /health`: 200 while the server serves, 503 while it warms up or drains (no token needed;
  not access-logged unless `log_health_checks`).
- `GET /v1/models`: the served model names.

Errors are OpenAI error objects with the status the one taxonomy gives (`service.errors`). Every
response carries `x-request-id`: the caller's (a plain token), else a new one, which is also on the
request's access-log line and every other log line written while it is handled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from service import tracing
from service.admission import Admission
from service.auth import BearerToken, presented_token, refusal
from service.engine import ChatInput, Encoding, Engine, GenerationResult, SamplingParams
from service.engine.vllm_ec import transfer_params
from service.errors import BadRequest, Failure, Kind, NotFound, TooLarge, failure_for
from service.http.sglang import add_sglang_routes
from service.logs import REQUEST_ID, log_access, request_id
from service.metrics import Metrics
from service.openai.images import ImageFetcher
from service.openai.request import ChatRequest, parse_chat_request, parse_producer_request
from service.openai.response import Reply, chunk, completion, error_body, new_id

log = logging.getLogger("kimi_vision.access")

HEALTH_PATH = "/health"
REQUEST_ID_HEADER = "x-request-id"
UNMATCHED = "unmatched"  # the `handler` label of a path no route serves (the path itself could be anything)

EXPORT_DTYPE = torch.bfloat16  # what vLLM's encoder cache holds for the K3 model (its activation dtype)


@dataclass(frozen=True)
class HttpConfig:
    max_body_bytes: int = 64 << 20  # one request body (the gRPC face's message limit)
    token: str | None = None  # bearer token required on /v1/* (None: open)
    allow_remote_images: bool = False
    ec_producer: bool = False  # --ec-role producer: export every request's images before replying
    tls_files: tuple[str, str] | None = None  # (certificate chain, key) PEM files: serve HTTPS


def _unauthorized(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
    return JSONResponse(body, status_code=401)


def _error(failure: Failure) -> JSONResponse:
    return JSONResponse(error_body(failure), status_code=failure.rule.http)


def create_app(admission: Admission, metrics: Metrics, config: HttpConfig, *,
               log_health_checks: bool = False) -> FastAPI:
    """The app on one server process's admission (which holds the engine) and metrics."""
    app = FastAPI(title="kimi-vision", docs_url=None, redoc_url=None, openapi_url=None)
    token = BearerToken(config.token) if config.token else None

    @app.middleware("http")
    async def access(request: Request, call_next: Any) -> Response:
        """The request id, auth on /v1/*, then the metrics and one access-log line per request (never
        content). A stream's time is to its first event (when its response starts)."""
        start = time.perf_counter()
        rid = request_id(request.headers.get(REQUEST_ID_HEADER))
        REQUEST_ID.set(rid)  # this request's task only
        path = request.url.path
        health = path == HEALTH_PATH
        span = contextlib.nullcontext() if health else tracing.span(
            f"{request.method} {path}", carrier=dict(request.headers),
            **{"http.request.method": request.method, "url.path": path, "kimi_vision.request_id": rid})
        with span as current:
            if token is not None and path.startswith("/v1/"):
                presented = presented_token(request.headers.getlist("authorization"))
                response = await call_next(request) if token.accepts(presented) else _unauthorized(refusal(presented))
            else:
                response = await call_next(request)
            if current is not None:
                current.set_attribute("http.response.status_code", response.status_code)
        response.headers[REQUEST_ID_HEADER] = rid
        seconds = time.perf_counter() - start
        route = request.scope.get("route")
        metrics.http_end(request.method, getattr(route, "path", UNMATCHED), response.status_code, seconds)
        if health and not log_health_checks:
            return response
        log_access(log, request_id=rid, method=f"{request.method} {path}",
                   peer=f"{request.client.host}:{request.client.port}" if request.client else "?",
                   status_name="status", status=str(response.status_code), seconds=seconds,
                   request_bytes=_length(request.headers), response_bytes=_length(response.headers))
        return response

    @app.get("/health")
    async def health() -> Response:
        if admission.serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> Response:
        engine = admission.engine
        if engine is None:
            return _error(Failure(Kind.UNAVAILABLE, "server is warming up; retry shortly"))
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kimi-vision", "root": engine.model_id,
                 "parent": None} for name in engine.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        stack = contextlib.AsyncExitStack()
        try:
            body = await _json_body(request, config.max_body_bytes)
            chat_request = (parse_producer_request if config.ec_producer else parse_chat_request)(body)
            engine = await stack.enter_async_context(admission.admit())
            if not engine.serves(chat_request.model):
                raise NotFound(f"the model {chat_request.model!r} does not exist here; this server serves "
                               f"{list(engine.served_model_names)}")
            reply = await _answer(engine, chat_request, config)
            if isinstance(reply, dict):
                await stack.aclose()
                return JSONResponse(reply)
            first = await anext(reply)  # the prefill: its errors are still a status, not a broken stream
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error, in one place
            await stack.aclose()
            return _error(failure_for(exc))

        async def events() -> AsyncIterator[str]:
            async with stack:  # the slot is held until the stream ends
                yield first
                try:
                    async for line in reply:
                        yield line
                except Exception as exc:  # noqa: BLE001 - mid-stream: an error event, then the end
                    yield f"data: {json.dumps(error_body(failure_for(exc)))}\n\n"
                    yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    add_sglang_routes(app, admission, lambda request: _json_body(request, config.max_body_bytes),
                      allow_remote_images=config.allow_remote_images)
    return app


def _length(headers: Any) -> int | None:
    """A message's declared content-length (None: not declared, as for a stream)."""
    declared = headers.get("content-length")
    return int(declared) if declared and declared.isdigit() else None


async def _json_body(request: Request, limit: int) -> Any:
    declared = _length(request.headers)
    if declared is not None and declared > limit:
        raise TooLarge(f"the request body is {declared:,} bytes; the limit is {limit:,}")
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise TooLarge(f"the request body is over the {limit:,}-byte limit")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def _answer(engine: Engine, request: ChatRequest, config: HttpConfig) -> dict[str, Any] | AsyncIterator[str]:
    """The reply: a `chat.completion` dict, or the stream's SSE lines (`stream: true`)."""
    fetcher = ImageFetcher(max_bytes=engine.config.limits.max_bytes, allow_remote=config.allow_remote_images)
    images = [await fetcher.fetch(part) for part in request.images]
    chat = request.chat_input(images)
    model = request.model or engine.served_model_names[0]
    reply_id = new_id()
    if config.ec_producer:  # the files are the answer: nothing is sampled
        encoding = await engine.encode(chat, export_dtype=EXPORT_DTYPE)
        return _encoded(encoding, model, reply_id, request)
    params = engine.sampling(request.max_tokens, **request.sampling)
    if not request.stream:
        reply = Reply()
        async with contextlib.aclosing(engine.generate(chat, params)) as items:
            async for item in items:
                reply.add(item)
        return completion(reply, model=model, request_id=reply_id)
    return _stream(engine, chat, params, model, reply_id, request.include_usage)


def _encoded(encoding: Encoding, model: str, reply_id: str,
             request: ChatRequest) -> dict[str, Any] | AsyncIterator[str]:
    """An EC producer's answer: no completion tokens; `ec_transfer_params` names each image's key."""
    reply = Reply()
    reply.add(GenerationResult("length", len(encoding.input_ids), sum(e.num_tokens for e in encoding.embeddings), 0))
    if request.stream:
        return _one_chunk(reply, model, reply_id, request.include_usage)
    body = completion(reply, model=model, request_id=reply_id)
    body["ec_transfer_params"] = transfer_params(encoding.mm_hashes, [e.grid_thw for e in encoding.embeddings])
    return body


async def _one_chunk(reply: Reply, model: str, reply_id: str, include_usage: bool) -> AsyncIterator[str]:
    """The streamed form: one chunk (the role, the finish reason; the usage if asked), then [DONE]."""
    usage = reply.usage() if include_usage else None
    last = chunk({"role": "assistant", "content": ""}, model=model, request_id=reply_id, created=int(time.time()),
                 finish_reason=reply.finish_reason, usage=usage)
    yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


async def _stream(engine: Engine, chat: ChatInput, params: SamplingParams, model: str, reply_id: str,
                  include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    reply = Reply()

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async with contextlib.aclosing(engine.generate(chat, params)) as items:
        started = False
        async for item in items:
            delta = reply.add(item)
            if not started:  # the first event: the role, as OpenAI streams begin
                started = True
                yield sse(chunk({"role": "assistant", "content": ""}, model=model, request_id=reply_id,
                                created=created))
            if delta is not None:
                yield sse(chunk(delta, model=model, request_id=reply_id, created=created))
    yield sse(chunk({}, model=model, request_id=reply_id, created=created, finish_reason=reply.finish_reason))
    if include_usage:
        yield sse(chunk(None, model=model, request_id=reply_id, created=created, usage=reply.usage()))
    yield "data: [DONE]\n\n"
