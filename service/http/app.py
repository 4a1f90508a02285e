"""The OpenAI-compatible HTTP face (FastAPI): what vLLM's disaggregated-encoder proxy and OpenAI
clients call, on the same engine, admission, limits, token and metrics as the gRPC face.

- `POST /v1/chat/completions`: a chat with images (`data:` URLs; `http(s)` ones only with
  `--allow-remote-images`) through the trunk, streamed as server-sent events with `stream: true`.
  In EC producer mode (`--ec-role producer`) every request is an encode request, whatever its
  `max_tokens` (every vLLM chat parameter is taken: nothing is sampled): its images are encoded and
  delivered by vLLM's shared-storage transport (`service.epd.vllm_storage`), and the answer is a
  `chat.completion` with no completion tokens, carrying `ec_transfer_params` as vLLM's producer
  reports them (per key: the item positions and the placeholder metadata), without the trunk. With
  `stream: true` it is one SSE chunk and `[DONE]`, without `ec_transfer_params`, as vLLM's streamed
  chunks carry none (its proxy asks with `stream: false`).
- SGLang's encoder protocol (`sglang.py`): `POST /encode`, `/scheduler_receive_url`, `GET /health_generate`;
  its bodies are read, and its images fetched, as the chat route reads and fetches them (here, or
  with `--epd-port` on an app of their own: `create_app(openai=False)`).
- `GET` (and `HEAD`) `/health`: 200 while the server serves, 503 while it warms up or drains (no
  token needed; not access-logged unless `log_health_checks`).
- `GET /v1/models`: the served model names (503 with admission's reason while there is no model:
  warming up, or failed to load).
- `POST /v1/completions`: vLLM's completions (a prompt of text or token ids, or a list of them),
  through the same pieces as the chat route: one admitted road (`admitted`), the same sampling
  (`service.openai.request`), one reply path for whole and streamed answers (`_reply`); the
  prompts of one request generate together. `POST /tokenize` and `/detokenize` in vLLM's shapes
  (a chat's images counted from their headers); `GET /version`.
- `GET` and `HEAD /metrics`: the registry the metrics port serves (`service.metrics.render`).

A chat completion's cost is admitted before the work: it takes its admission place before its
body is read (a bounded number of bodies read at once, each within `body_timeout_s`: a slow
client gets 408 and is closed), then every cheap check (the model, the image count, the sampling
values, `max_tokens` against the model length) before the first remote image is fetched (all of
them at once, outside the work slots), and only then a work slot. If the client goes away at any
point, streaming or not, the work is cancelled there (the engine stops at its next token) and the
access log says 499.

Errors, every one (404, 405, 408, 413, 429, 431, ...), are rendered in one place
(`service.http.errors`): OpenAI error objects here, SGLang's body on its routes, each with the
status, type and connection handling its kind has in `service.errors.RULES`; 401 carries
`WWW-Authenticate: Bearer`. The bearer token guards the routes that do work for a caller (`/v1/*`,
`/tokenize`, `/detokenize`: `TOKEN_PATHS`), not `/health`, `/version` or `/metrics`. Every
response carries `x-request-id`: the caller's (a plain token), else a new one, which is also on
the request's access-log line and every other log line written while it is handled. Metric labels
come from fixed sets (a method outside them is "other", a path no route serves "unmatched").
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from service import tracing
from service.admission import Admission, Ticket
from service.auth import BearerToken
from service.engine import Choice, Encoding, Engine, GenerationResult, MediaInput, Prepared
from service.engine.store import ItemKey
from service.epd.base import Delivery
from service.epd.sglang_encoder import SglangEncoder
from service.epd.vllm_storage import VllmStorageSink
from service.errors import (
    ClientGone,
    HeadersTooLarge,
    MethodNotAllowed,
    NotFound,
    SlowClient,
    TooLarge,
    Unavailable,
    failure_for,
)
from service.fetch import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT_S, MediaFetcher
from service.http.errors import error_response
from service.http.gone import unless_disconnected
from service.http.sglang import add_sglang_routes
from service.jsontext import parse_json
from service.logs import REQUEST_ID, log_access, request_id
from service.media import MediaRef
from service.metrics import METRICS_PATH, Metrics, render
from service.openai.request import (
    ChatRequest,
    CompletionRequest,
    Streaming,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_producer_request,
    parse_tokenize_request,
)
from service.openai.response import (
    CompletionReply,
    Reply,
    TokenCounts,
    chunk,
    completion,
    error_body,
    new_id,
    text_completion,
)

log = logging.getLogger("kimi_vision.access")
T = TypeVar("T")
VERSION = importlib.metadata.version("kimi-vision")

HEALTH_PATH = "/health"
REQUEST_ID_HEADER = "x-request-id"
# Beside /v1/*, the routes that do work for a caller (a chat's images fetched and read): behind the
# bearer token, as vLLM's api key guards only /v1 but an image fetch must not be open.
TOKEN_PATHS = frozenset({"/tokenize", "/detokenize"})
UNMATCHED = "unmatched"  # the `handler` label of a path no route serves (the path itself could be anything)


@dataclass(frozen=True)
class HttpConfig:
    max_body_bytes: int = 64 << 20  # one request body (the gRPC face's message limit)
    max_header_bytes: int = 16 << 10  # the request line and headers together (more: 431)
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive within this (else 408)
    body_timeout_s: float = 60.0  # a body must arrive within this once its reading starts (else 408)
    token: str | None = None  # bearer token required on /v1/* (None: open)
    allow_remote_images: bool = False
    allowed_media_domains: tuple[str, ...] | None = None  # only these hosts are fetched (None: any public one)
    media_fetch_timeout_s: float = DEFAULT_TIMEOUT_S  # a request's remote images, all of them
    max_media_fetches: int = DEFAULT_CONCURRENCY  # remote image fetches at once, over all requests
    ec_producer: bool = False  # --ec-role producer: export every request's images before replying
    tls_files: tuple[str, str] | None = None  # (certificate chain, key) PEM files: serve HTTPS


class _Stream(StreamingResponse):
    """Server-sent events that own their request's admission and generation (`stack`): both are
    given back however the stream ends (finished, failed, or its client gone, even before it began)."""

    def __init__(self, events: AsyncIterator[str], stack: contextlib.AsyncExitStack) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._stack = stack

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


def _length(headers: Any) -> int | None:
    """A message's declared content-length (None: not declared, as for a stream)."""
    declared = headers.get("content-length")
    return int(declared) if declared and declared.isdigit() else None


class HttpApp:
    """The face as uvicorn runs it: the FastAPI app, and around it, before any route, the request
    id, the header size and the token on /v1/*; after it, the metrics and one access-log line per
    request (never content), and an OpenAI error object for a failure nothing else answered. A
    response's time is to its start (a stream's: its first event)."""

    def __init__(self, app: FastAPI, metrics: Metrics, config: HttpConfig, log_health_checks: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.config = config
        self.token = BearerToken(config.token) if config.token else None
        self.log_health_checks = log_health_checks

    def _refusal(self, scope: dict[str, Any], headers: Headers) -> Response | None:
        size = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(name) + len(value) + 4 for name, value in scope["headers"])
        if size > self.config.max_header_bytes:
            return error_response(failure_for(HeadersTooLarge(
                f"the request line and headers hold {size:,} bytes; the limit is {self.config.max_header_bytes:,}")))
        if self.token is None or not (scope["path"].startswith("/v1/") or scope["path"] in TOKEN_PATHS):
            return None
        refused = self.token.refusal(headers.getlist("authorization"))
        if refused is None:
            return None
        log.warning("refused %s %s: %s", scope["method"], scope["path"], refused)
        return error_response(failure_for(refused))

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        REQUEST_ID.set(rid)  # this request's task only
        method, path = scope["method"], scope["path"]
        health = path == HEALTH_PATH
        answered: dict[str, Any] = {}

        async def observed(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answered.update(status=message["status"], seconds=time.perf_counter() - start,
                                bytes=_length(Headers(raw=message.get("headers", []))))
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        span = contextlib.nullcontext() if health else tracing.span(
            f"{method} {path}", carrier=dict(headers),
            **{"http.request.method": method, "url.path": path, "kimi_vision.request_id": rid})
        with span as current:
            try:
                refusal = self._refusal(scope, headers)
                await (refusal or self.app)(scope, receive, observed)
            except Exception as exc:  # noqa: BLE001 - a failure no handler answered: still an OpenAI error
                if "status" not in answered:  # else the app's own handler answered (and logged) it
                    await error_response(failure_for(exc))(scope, receive, observed)
            status = answered.get("status", 500)
            if current is not None:
                current.set_attribute("http.response.status_code", status)
        seconds = answered.get("seconds", time.perf_counter() - start)
        route = scope.get("route")
        self.metrics.http_end(method, getattr(route, "path", UNMATCHED), status, seconds)
        if health and not self.log_health_checks:
            return
        client = scope.get("client")
        log_access(log, request_id=rid, method=f"{method} {_printable(path)}",
                   peer=f"{client[0]}:{client[1]}" if client else "?", status_name="status", status=str(status),
                   seconds=seconds, request_bytes=_length(headers), response_bytes=answered.get("bytes"))

    def refused(self, status: int, peer: str, seconds: float) -> None:
        """Count and log a connection the HTTP protocol refused before any request could reach the
        app (408 for a head too slow, 431, 400 for bytes that are not HTTP)."""
        self.metrics.http_end("", UNMATCHED, status, seconds)
        log_access(log, request_id=request_id(None), method="-", peer=peer, status_name="status", status=str(status),
                   seconds=seconds, request_bytes=None, response_bytes=None)


def _printable(path: str) -> str:
    """A path as a log line may hold it (a caller's path could carry a newline, or be huge)."""
    shown = path if path.isprintable() else path.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 200 else shown[:200] + "..."


def one_fetcher(config: HttpConfig) -> Callable[[Engine], MediaFetcher]:
    """The face's one media fetcher, made on first use with the engine's per-item limit and shared
    by every request of every listener it is given to (`--max-media-fetches` is over all of them)."""
    fetchers: list[MediaFetcher] = []

    def fetcher(engine: Engine) -> MediaFetcher:
        if not fetchers:
            fetchers.append(MediaFetcher(engine.config.limits.max_bytes, allow_remote=config.allow_remote_images,
                                         timeout_s=config.media_fetch_timeout_s,
                                         allowed_domains=config.allowed_media_domains,
                                         concurrency=config.max_media_fetches))
        return fetchers[0]

    return fetcher


def create_app(admission: Admission, metrics: Metrics, config: HttpConfig, *, log_health_checks: bool = False,
               openai: bool = True, sglang: SglangEncoder | None = None,
               fetcher: Callable[[Engine], MediaFetcher] | None = None) -> HttpApp:
    """The face on one server process's admission (which holds the engine) and metrics: `/health`,
    and the OpenAI routes, SGLang's (the server's one `sglang` encoder), or both (`--epd-port`
    serves SGLang's on a listener of their own)."""
    app = FastAPI(title="kimi-vision", docs_url=None, redoc_url=None, openapi_url=None)
    face = HttpApp(app, metrics, config, log_health_checks)
    routes = APIRouter()  # the OpenAI routes, included when served here
    fetcher = fetcher or one_fetcher(config)

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, exc: HTTPException) -> Response:  # the router's 404 and 405
        if exc.status_code == 405:
            allowed = Headers(headers=exc.headers or {}).get("allow")
            error: Exception = MethodNotAllowed(f"{_printable(request.method)} is not allowed on "
                                                f"{_printable(request.url.path)}; allowed: {allowed}")
        elif exc.status_code == 404:
            error = NotFound(f"no such route: {_printable(request.url.path)}")
        else:  # the router raises no other status; one would be a bug, answered as one
            error = exc
        return error_response(failure_for(error), extra_headers=exc.headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        return error_response(failure_for(exc))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if admission.serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    @routes.get("/v1/models")
    async def models() -> Response:
        engine = admission.engine
        if engine is None:  # not loaded yet, or never (admission says which)
            return error_response(failure_for(admission.refusal() or Unavailable("server has no model loaded")))
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kimi-vision", "root": engine.model_id,
                 "parent": None} for name in engine.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    def served(model: str | None) -> Engine:
        """The engine, if `model` names it (admission waited for the engine before the body was read)."""
        engine = admission.engine
        if not engine.serves(model):
            raise NotFound(f"the model {model!r} does not exist here; this server serves "
                           f"{list(engine.served_model_names)}")
        return engine

    async def admitted(request: Request, answer: Callable[[Ticket, Any, contextlib.AsyncExitStack],
                                                           Awaitable[Response]]) -> Response:
        """A POST route's one road: a queue place before the body is read, the body, then `answer`
        (which takes a work slot when it needs one, into the stack); the client leaving cancels it
        wherever it is, and every failure becomes an OpenAI error here."""
        stack = contextlib.AsyncExitStack()
        streaming = False
        try:
            ticket = await stack.enter_async_context(admission.enter())
            body = await _read_body(request, ticket, config)
            response = await unless_disconnected(request, answer(ticket, body, stack))
            streaming = isinstance(response, _Stream)  # the stream closes the stack when it ends
            return response
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error, in one place
            return error_response(failure_for(exc))
        finally:
            if not streaming:
                await stack.aclose()

    async def chat(ticket: Ticket, body: Any, stack: contextlib.AsyncExitStack) -> Response:
        request = (parse_producer_request if config.ec_producer else parse_chat_request)(body)
        engine = served(request.model)
        # The cheap checks, before any item is fetched: their count and modality, the sampling, the length.
        checked = engine.check(request.media, request.chat, request.params)
        sink = VllmStorageSink.of(engine) if config.ec_producer else None  # (the export directory is set)
        if sink is not None:
            sink.check(request.media)
        media = await fetch(engine, request.media)
        # Each item's key, every uuid rule checked, before any pixel is encoded.
        keys = None if sink is None else await engine.run_cpu(sink.keys, media)
        # A generation takes no work slot (the trunk's scheduler bounds generations); an encode does.
        engine = await stack.enter_async_context(ticket.work(generation=sink is None))
        prepared = await engine.prepare(checked, media, request.chat)
        return await _reply(await _answer(engine, request, prepared, sink, keys), stack)

    async def complete(ticket: Ticket, body: Any, stack: contextlib.AsyncExitStack) -> Response:
        request = parse_completion_request(body)
        engine = served(request.model)
        checked = engine.check([], None, request.params)
        engine = await stack.enter_async_context(ticket.work(generation=True))
        single = len(request.prompts) == 1
        prepared = [await engine.prepare_text(checked, prompt, "prompt" if single else f"prompt[{i}]")
                    for i, prompt in enumerate(request.prompts)]
        echoes = None
        if request.echo:
            echoes = [prompt if isinstance(prompt, str) else await engine.detokenize(prompt, "prompt")
                      for prompt in request.prompts]
        model = request.model or engine.served_model_names[0]
        return await _reply(await _completions(engine, request, prepared, echoes, model), stack)

    async def count(ticket: Ticket, body: Any, stack: contextlib.AsyncExitStack) -> Response:
        request = parse_tokenize_request(body)
        engine = served(request.model)
        if request.chat is None:
            ids = await engine.text_ids(request.prompt)
        else:  # its images counted from their headers, as CountTokens counts them
            checked = engine.check(request.media, request.chat)
            media = await fetch(engine, request.media)
            engine = await stack.enter_async_context(ticket.work())
            ids = (await engine.prepare(checked, media, request.chat)).prompt.ids
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len or 0, "tokens": ids})

    async def decode(ticket: Ticket, body: Any, stack: contextlib.AsyncExitStack) -> Response:
        request = parse_detokenize_request(body)
        engine = served(request.model)
        return JSONResponse({"prompt": await engine.detokenize(request.tokens, "tokens")})

    async def fetch(engine: Engine, refs: list[MediaRef]) -> list[MediaInput]:
        """The request's media, its remote items fetched together (not holding a work slot)."""
        data = await fetcher(engine).fetch_all(refs)
        return [ref.input(item) for ref, item in zip(refs, data, strict=True)]

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await admitted(request, chat)

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await admitted(request, complete)

    @routes.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await admitted(request, count)

    @routes.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await admitted(request, decode)

    @routes.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    @routes.api_route(METRICS_PATH, methods=["GET", "HEAD"])
    async def scrape(request: Request) -> Response:  # the registry --metrics-port serves
        headers, content = render(metrics.registry, accept=request.headers.get("accept", ""),
                                  accept_encoding=request.headers.get("accept-encoding", ""),
                                  query=request.url.query)
        return Response(content, headers=dict(headers))

    async def read_json(request: Request) -> Any:
        """A body as the chat route reads one: a queue place and a body slot while it comes, within
        the body timeout (the work that follows is admitted on its own)."""
        async with admission.enter() as ticket:
            return await _read_body(request, ticket, config)

    if openai:
        app.include_router(routes)
    if sglang is not None:
        add_sglang_routes(app, admission, read_json, sglang)
    return face


async def _read_body(request: Request, ticket: Ticket, config: HttpConfig) -> Any:
    """The body, parsed: its size checked first (declared, then as it comes), read once a body
    slot is free (`Ticket.reading`) and within the body timeout from then, into one buffer of the
    declared size (no copies as it grows, nothing for the allocator to keep of them). It is parsed
    on the event loop: json.loads holds the GIL, so a thread would not free the loop meanwhile, and
    one thread (this one) keeps the parse's memory in one allocator arena, as a pool's threads did not."""
    limit = config.max_body_bytes
    declared = _length(request.headers)
    if declared is not None and declared > limit:
        raise TooLarge(f"the request body is {declared:,} bytes; the limit is {limit:,}")
    async with ticket.reading():
        raw = bytearray(declared or 0)
        size = 0
        try:
            async with asyncio.timeout(config.body_timeout_s):
                async for piece in request.stream():
                    end = size + len(piece)
                    if end > limit:
                        raise TooLarge(f"the request body is over the {limit:,}-byte limit")
                    if end <= len(raw):
                        raw[size:end] = piece
                    else:  # not declared (chunked): grown as it comes
                        raw += piece
                    size = end
        except TimeoutError:
            came = f"{size:,} bytes came" + (f" of {declared:,}" if declared is not None else "")
            raise SlowClient(f"the request body did not arrive within {config.body_timeout_s:g} s ({came})") from None
        except ClientDisconnect:
            raise ClientGone("the client closed the connection while sending the body") from None
        return parse_json(raw, "the request body")


async def _reply(reply: dict[str, Any] | AsyncIterator[str], stack: contextlib.AsyncExitStack) -> Response:
    """A whole answer, or a stream whose first event (which waits for the prefill: its errors are
    still a status, not a broken stream) has come; a later failure is an error event, then the end."""
    if isinstance(reply, dict):
        return JSONResponse(reply)
    stack.push_async_callback(reply.aclose)  # the generation stops first, then the slot is given back
    first = await anext(reply)

    async def events() -> AsyncIterator[str]:
        yield first
        try:
            async for line in reply:
                yield line
        except Exception as exc:  # noqa: BLE001 - mid-stream: an error event, then the end
            yield _sse(error_body(failure_for(exc)))
            yield "data: [DONE]\n\n"

    return _Stream(events(), stack)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _answer(engine: Engine, request: ChatRequest, prepared: Prepared, sink: VllmStorageSink | None,
                  keys: list[ItemKey] | None) -> dict[str, Any] | AsyncIterator[str]:
    """The reply: a `chat.completion` dict, or the stream's SSE lines (`stream: true`)."""
    model = request.model or engine.served_model_names[0]
    reply_id = new_id()
    if sink is not None and keys is not None:  # the files are the answer: nothing is sampled
        encoding = await engine.encode(prepared)
        return _encoded(encoding, await sink.deliver(engine, encoding, keys), model, reply_id, request)
    if not request.streaming.stream:
        reply = Reply()
        async with contextlib.aclosing(engine.generate(prepared)) as items:
            async for item in items:
                reply.add(item)
        return completion(reply, model=model, request_id=reply_id)
    return _stream(engine, prepared, model, reply_id, request.streaming)


def _encoded(encoding: Encoding, delivery: Delivery, model: str, reply_id: str,
             request: ChatRequest) -> dict[str, Any] | AsyncIterator[str]:
    """An EC producer's answer: no completion tokens; `ec_transfer_params` names each item's key
    (in the `chat.completion`; the streamed chunk has none, as vLLM's)."""
    reply = Reply()
    media_tokens = sum(e.num_tokens for e in encoding.embeddings)
    reply.add(Choice(0, GenerationResult("length", len(encoding.input_ids), media_tokens, 0)))
    if request.streaming.stream:
        return _one_chunk(reply, model, reply_id, request.streaming.include_usage)
    body = completion(reply, model=model, request_id=reply_id)
    body["ec_transfer_params"] = delivery.transfer_params
    return body


async def _one_chunk(reply: Reply, model: str, reply_id: str, include_usage: bool) -> AsyncIterator[str]:
    """The streamed form: one chunk (the role, the finish reason; the usage if asked), then [DONE]."""
    usage = reply.usage() if include_usage else None
    part = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": reply.choices[0].finish_reason}
    yield _sse(chunk([part], model=model, request_id=reply_id, created=int(time.time()), usage=usage))
    yield "data: [DONE]\n\n"


async def _stream(engine: Engine, prepared: Prepared, model: str, reply_id: str,
                  streaming: Streaming) -> AsyncIterator[str]:
    """Each choice's chunks as its items come: the role first (as OpenAI streams begin), its deltas
    (with the logprobs of their tokens), its finish reason; then the usage of all, then [DONE].
    With continuous usage, every chunk carries the usage so far."""
    created = int(time.time())
    reply = Reply()
    counts = TokenCounts(len(prepared.prompt.ids))

    def sse(choices: list[dict[str, Any]]) -> str:
        usage = counts.usage() if streaming.continuous_usage else None
        return _sse(chunk(choices, model=model, request_id=reply_id, created=created, usage=usage))

    async with contextlib.aclosing(engine.generate(prepared, counts.add)) as items:
        async for item in items:
            if item.index not in reply.choices:
                yield sse([{"index": item.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])
            part = reply.add(item)
            if part is not None:
                yield sse([part])
    if streaming.include_usage:
        yield _sse(chunk([], model=model, request_id=reply_id, created=created, usage=reply.usage()))
    yield "data: [DONE]\n\n"


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's index; leaving early (or
    one failing) closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as items:
            async for item in items:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(k: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((k, item))
            queue.put_nowait((k, end))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who raises it
            queue.put_nowait((k, exc))

    tasks = [asyncio.create_task(pump(k, stream)) for k, stream in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _completions(engine: Engine, request: CompletionRequest, prepared: list[Prepared], echoes: list[str] | None,
                       model: str) -> dict[str, Any] | AsyncIterator[str]:
    """The reply to a completions request: a `text_completion` dict, or the stream's SSE lines.
    Its prompts generate together, each in the trunk's batch as its own request."""
    reply = CompletionReply(len(prepared), request.params.n, echoes)
    counts = TokenCounts(sum(len(p.prompt.ids) for p in prepared))
    items = _merged([engine.generate(p, counts.add) for p in prepared])
    reply_id = new_id("cmpl")
    if not request.streaming.stream:
        async with contextlib.aclosing(items):
            async for k, item in items:
                reply.choice(k, item.index)[0].add(item.item)
        return text_completion(reply, model=model, request_id=reply_id)
    return _completion_stream(items, reply, counts, model, reply_id, request.streaming)


async def _completion_stream(items: AsyncIterator[tuple[int, Choice]], reply: CompletionReply, counts: TokenCounts,
                             model: str, reply_id: str, streaming: Streaming) -> AsyncIterator[str]:
    """A choice's chunks as its items come (its prompt's text first, with echo); then the usage of
    all, then [DONE]. With continuous usage, every chunk carries the usage so far."""
    created = int(time.time())

    def sse(choices: list[dict[str, Any]]) -> str:
        usage = counts.usage() if streaming.continuous_usage else None
        return _sse(chunk(choices, model=model, request_id=reply_id, created=created, usage=usage,
                          kind="text_completion"))

    async with contextlib.aclosing(items):
        async for k, item in items:
            choice, new = reply.choice(k, item.index)
            if new and choice.text:
                yield sse([{"index": choice.index, "text": choice.text, "logprobs": None, "finish_reason": None,
                            "stop_reason": None}])
            part = choice.add(item.item)
            if part is not None:
                yield sse([part])
    if streaming.include_usage:
        yield _sse(chunk([], model=model, request_id=reply_id, created=created, usage=reply.usage(),
                         kind="text_completion"))
    yield "data: [DONE]\n\n"
