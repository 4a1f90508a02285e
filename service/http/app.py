"""The OpenAI-compatible HTTP face (FastAPI): what vLLM's disaggregated-encoder proxy and OpenAI
clients call, on the same engine, admission, limits, token and metrics as the gRPC face.

- `POST /v1/chat/completions`: a chat with images (`data:` URLs; `http(s)` ones only with
  `--allow-remote-images`) through the trunk, streamed as server-sent events with `stream: true`.
  In EC producer mode (`--ec-role producer`) every image of the request is first encoded and
  written under the key vLLM looks it up by; a request with `max_tokens: 1` (what vLLM's proxy
  sends the encoder) is then answered at once with a valid `chat.completion`, without the trunk.
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
from service.engine import ChatInput, Choice, Engine, GenerationResult, SamplingParams
from service.errors import BadRequest, Failure, Kind, NotFound, TooLarge, failure_for
from service.logs import REQUEST_ID, log_access, request_id
from service.metrics import Metrics
from service.openai.images import ImageFetcher
from service.openai.request import ChatRequest, parse_chat_request
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
            chat_request = parse_chat_request(body)
            generation = not _encode_only(chat_request, config)
            engine = await stack.enter_async_context(admission.admit(generation=generation))
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


def _encode_only(request: ChatRequest, config: HttpConfig) -> bool:
    """vLLM's proxy priming the encoder (`max_tokens` 1 in EC producer mode): answered without the trunk."""
    return config.ec_producer and bool(request.images) and request.max_tokens == 1


async def _answer(engine: Engine, request: ChatRequest, config: HttpConfig) -> dict[str, Any] | AsyncIterator[str]:
    """The reply: a `chat.completion` dict, or the stream's SSE lines (`stream: true`)."""
    fetcher = ImageFetcher(max_bytes=engine.config.limits.max_bytes, allow_remote=config.allow_remote_images)
    images = [await fetcher.fetch(part) for part in request.images]
    chat = request.chat_input(images)
    model = request.model or engine.served_model_names[0]
    reply_id = new_id()
    if config.ec_producer and chat.images:
        encoding = await engine.encode(chat, export_dtype=EXPORT_DTYPE)
        if _encode_only(request, config):  # vLLM's proxy priming the encoder: the files are what it wanted
            image_tokens = sum(e.num_tokens for e in encoding.embeddings)
            reply = Reply()
            reply.add(Choice(0, GenerationResult("length", len(encoding.input_ids), image_tokens, 0)))
            return completion(reply, model=model, request_id=reply_id)
    params = engine.sampling(request.max_tokens, **request.sampling)
    if not request.stream:
        reply = Reply()
        async with contextlib.aclosing(engine.generate(chat, params)) as items:
            async for item in items:
                reply.add(item)
        return completion(reply, model=model, request_id=reply_id)
    return _stream(engine, chat, params, model, reply_id, request.include_usage)


async def _stream(engine: Engine, chat: ChatInput, params: SamplingParams, model: str, reply_id: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """Each choice's chunks as its items come: the role first (as OpenAI streams begin), its deltas
    (with the logprobs of their tokens), its finish reason; then the usage of all, then [DONE]."""
    created = int(time.time())
    reply = Reply()

    def sse(choices: list[dict[str, Any]], **usage: Any) -> str:
        body = chunk(choices, model=model, request_id=reply_id, created=created, **usage)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async with contextlib.aclosing(engine.generate(chat, params)) as items:
        async for item in items:
            if item.index not in reply.choices:
                yield sse([{"index": item.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])
            part = reply.add(item)
            if part is not None:
                yield sse([part])
    if include_usage:
        yield sse([], usage=reply.usage())
    yield "data: [DONE]\n\n"
