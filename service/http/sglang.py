"""SGLang 0.5.23's encoder disaggregation on the HTTP face: this server as the encoder
(`--encoder-only`) of SGLang language servers (`--language-only --encoder-urls`), on the same port
as the OpenAI API. The routes, fields and answers are those of SGLang's own encoder server
(sglang/srt/disaggregation/encoder/http_server.py and runtime.py):

- `POST /encode` `{req_id, mm_items, modality, num_parts, part_idx, prefill_host, embedding_port, ...}`:
  one part of a request's images (`mm_items`: `data:` URLs, or `http(s)` ones with
  `--allow-remote-images`; a `{"url": ..., "content_hash": ...}` item too) is embedded by the
  engine and pushed to the language side over ZMQ as SGLang's receiver reads it (`sglang_wire`).
  It is admitted as the chat route is: its place first, the image count, then its images fetched
  by the face's one fetcher (the same rules: `--allowed-media-domains`, `--media-fetch-timeout`,
  `--max-media-fetches`; all at once, outside the work slots), and only then a work slot.
  Where to, the request says: `embedding_port` an int is `zmq_to_tokenizer` (push to
  `prefill_host:embedding_port`); absent or null is `zmq_to_scheduler` (push to every scheduler rank
  that registers the part, once `receive_count` have); a list of ports pushes to each at
  `prefill_host`. Both backends are served at once, request by request. The answer, after the push:
  200 `null`. The request keeps its admission place (not its work slot) until the push ends, so a
  drain waits for the rows to reach the language side.
- `POST /scheduler_receive_url` `{req_id, receive_count, receive_url, modality}`: a scheduler rank
  names where it takes a part (`zmq_to_scheduler`); before or after that part's `/encode` arrives.
- `GET /health_generate`: a fresh tiny image through the engine when it is idle (200, else 503); `GET /health` is
  the face's own (200 serving, 503 warming up or draining), which SGLang's encoder registry probes.
- `POST /send`, `POST /scheduler_receive_meta_data`: SGLang's `mooncake` (RDMA) backend, not served:
  a clear error, which also ends a waiting `/encode` of that part at once.

A failure (a bad image, a full server, a bad field) is answered at once as SGLang's encoder answers
it, `{"status": "error", "message", "req_id"}` with the status of the error taxonomy, and, once the
part's destination is known, also pushed there as SGLang's error `EmbeddingData`: the language side
fails the request then, instead of waiting for its timeout. These routes take no token: SGLang's
language side sends none (keep the port on the cluster network).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from service.admission import Admission, Ticket
from service.engine import Engine, ImageEmbedding, ImageInput
from service.errors import BadRequest, DeadlineExceeded, Failure, Unavailable, Unsupported, failure_for
from service.http.sglang_wire import ROW_DTYPE, error_frames, part_frames
from service.openai.images import ImageFetcher
from service.openai.request import ImagePart

log = logging.getLogger("kimi_vision.sglang")

# SGLang's own bounds (SGLANG_ENCODER_SEND_TIMEOUT, SGLANG_ENCODER_REQ_TIMEOUT: 180 s by default):
# how long a push may take, and how long a part waits for its scheduler ranks to register.
SEND_TIMEOUT_S = 180.0
REGISTRATION_TIMEOUT_S = 180.0
# How often a push looks whether its frames have left: from the first pause, doubling, up to the longest.
FIRST_POLL_S, LONGEST_POLL_S = 0.001, 0.05
# Item options SGLang passes along that change an image's preprocessing: this encoder preprocesses
# every image as the release does, so they are refused by name (`content_hash` only names the item).
_ITEM_KEYS = {"url", "content_hash"}
_MOONCAKE = ("the mooncake (RDMA) transfer backend is not served by this encoder; run the SGLang language server "
             "with --encoder-transfer-backend zmq_to_scheduler or zmq_to_tokenizer")

JsonReader = Callable[[Request], Awaitable[Any]]
FetcherOf = Callable[[Engine], ImageFetcher]  # the face's one fetcher (made with the engine's per-image limit)


@dataclass(frozen=True)
class EncodePart:
    """One `/encode` request: a part of a language-side request's images and where they go."""

    req_id: str
    num_parts: int
    part_idx: int
    items: list[ImagePart]
    prefill_host: str | None
    embedding_port: int | list[int] | None  # int: zmq_to_tokenizer; None: zmq_to_scheduler; list: direct


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _item(item: Any, where: str) -> ImagePart:
    if isinstance(item, str) and item:
        return ImagePart(item, where)
    if isinstance(item, Mapping) and isinstance(item.get("url"), str) and item["url"]:
        options = sorted(key for key, value in item.items() if key not in _ITEM_KEYS and value is not None)
        if options:
            raise Unsupported(f"{where}: {options} are not supported; this encoder preprocesses every image as "
                              "Kimi-K3's release processor does")
        return ImagePart(item["url"], where)
    raise BadRequest(f"{where}: an item is an image URL string or {{'url': ...}}")


def parse_encode_request(body: Any) -> EncodePart:
    """Check a `/encode` body as SGLang's encoder does (`validate_encode_request`), and that it asks
    for what this encoder serves (images; preprocessing as the release does)."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request is not a dict: {type(body).__name__}")
    req_id = body.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise BadRequest("missing or invalid req_id")
    modality = body.get("modality")
    if not isinstance(modality, str) or modality.upper() not in ("IMAGE", "VIDEO", "AUDIO"):
        raise BadRequest(f"unsupported modality: {modality}" if isinstance(modality, str)
                         else "missing or invalid modality")
    if modality.upper() != "IMAGE":
        raise Unsupported(f"modality {modality} is not supported; Kimi-K3 takes images")
    items = body.get("mm_items")
    items = [items] if isinstance(items, str | Mapping) else items
    if not isinstance(items, list) or not items:
        raise BadRequest("missing or empty mm_items")
    num_parts, part_idx = body.get("num_parts"), body.get("part_idx")
    if not _positive_int(num_parts):
        raise BadRequest("num_parts must be a positive integer")
    if not isinstance(part_idx, int) or isinstance(part_idx, bool) or not 0 <= part_idx < num_parts:
        raise BadRequest(f"part_idx must be in [0, {num_parts})")
    port = body.get("embedding_port")
    ports = port if isinstance(port, list) else [port] if port is not None else []
    if not all(_positive_int(p) and p < 65536 for p in ports) or (isinstance(port, list) and not port):
        raise BadRequest(f"embedding_port must be a port, a list of ports or null, got {port!r}")
    host = body.get("prefill_host")
    if ports and (not isinstance(host, str) or not host):
        raise BadRequest("prefill_host is needed with an embedding_port")
    return EncodePart(req_id, num_parts, part_idx, [_item(item, f"mm_items[{i}]") for i, item in enumerate(items)],
                      host, port)


def parse_registration(body: Any) -> tuple[str, int, str]:
    """A `/scheduler_receive_url` body: the part, how many ranks will register it, this rank's address."""
    fields = body if isinstance(body, Mapping) else {}
    req_id, count, url = fields.get("req_id"), fields.get("receive_count"), fields.get("receive_url")
    if not isinstance(req_id, str) or not req_id:
        raise BadRequest("missing or invalid req_id")
    if not _positive_int(count):
        raise BadRequest("receive_count must be a positive integer")
    if not isinstance(url, str) or ":" not in url:
        raise BadRequest(f"receive_url must be host:port, got {url!r}")
    return req_id, count, url


def _host_port(host: str, port: int) -> str:
    """SGLang's `NetworkAddress.to_host_port_str`: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class _Part:
    """Where a `zmq_to_scheduler` part goes, as its scheduler ranks register it."""

    born: float = field(default_factory=time.monotonic)
    expected: int | None = None  # receive_count: the ranks that will register (the TP size)
    urls: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False  # its /encode is delivering it
    refused: str | None = None  # a rank asked for what is not served (mooncake)


class Destinations:
    """The scheduler ranks registered per part (`req_id`), kept until its `/encode` delivered it; a
    registration whose `/encode` never comes is dropped after REGISTRATION_TIMEOUT_S."""

    def __init__(self) -> None:
        self._parts: dict[str, _Part] = {}

    def get(self, req_id: str) -> _Part:
        now = time.monotonic()
        for stale in [key for key, part in self._parts.items()
                      if not part.claimed and now - part.born > REGISTRATION_TIMEOUT_S]:
            del self._parts[stale]
        return self._parts.setdefault(req_id, _Part())

    def register(self, req_id: str, count: int, url: str) -> None:
        part = self.get(req_id)
        if part.expected is not None and part.expected != count:
            raise BadRequest(f"Inconsistent receive_count for req_id={req_id}: registered {part.expected}, got {count}")
        part.expected = count
        if url not in part.urls:
            part.urls.append(url)
        part.changed.set()

    def refuse(self, req_id: str, message: str) -> None:
        part = self.get(req_id)
        part.refused = message
        part.changed.set()

    def release(self, req_id: str) -> None:
        self._parts.pop(req_id, None)


async def _sent(tracker: zmq.MessageTracker, timeout_s: float) -> bool:
    """Whether ZMQ is done with the tracked frames within `timeout_s`: looked at from the event loop,
    so a slow peer holds no thread (the default executor also resolves hosts and loads the engine)."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_POLL_S
    while not tracker.done:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(2 * pause, LONGEST_POLL_S)
    return True


class Pusher:
    """ZMQ PUSH to the language side, as SGLang's encoder sends: connect, send the frames (waiting
    for the peer, `IMMEDIATE`), let the socket flush them, close."""

    def __init__(self) -> None:
        self._context: zmq.asyncio.Context | None = None

    def close(self) -> None:
        """Close every socket at once (what is still queued is dropped: the server is stopping)."""
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def push(self, host_port: str, frames: list[Any]) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        timeout_ms = int(SEND_TIMEOUT_S * 1000)
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, timeout_ms)  # the frames still queued when it closes are flushed
        try:
            sock.connect(f"tcp://{host_port}")
            tracker = await sock.send_multipart(frames, copy=False, track=True)
            if not await _sent(tracker, SEND_TIMEOUT_S):
                raise Unavailable(f"cannot push the embedding to {host_port}: not sent within {SEND_TIMEOUT_S:g} s")
        except zmq.ZMQError as exc:
            raise Unavailable(f"cannot push the embedding to {host_port}: {exc}") from None
        finally:
            sock.close()

    async def to_ranks(self, destinations: Destinations, req_id: str, frames: list[Any]) -> None:
        """Push to each scheduler rank of the part as it registers, until `receive_count` have."""
        part = destinations.get(req_id)
        part.claimed = True
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        pushes: list[asyncio.Task[None]] = []
        try:
            while True:
                if part.refused is not None:
                    raise Unsupported(part.refused)
                pushes += [asyncio.create_task(self.push(url, frames)) for url in part.urls[len(pushes):]]
                if part.expected is not None and len(pushes) >= part.expected:
                    break
                part.changed.clear()
                try:
                    await asyncio.wait_for(part.changed.wait(), deadline - time.monotonic())
                except TimeoutError:
                    raise DeadlineExceeded(f"{req_id}: {len(pushes)} of {part.expected or 'its'} scheduler ranks "
                                           f"registered within {REGISTRATION_TIMEOUT_S:g} s") from None
            await asyncio.gather(*pushes)
        finally:
            for push in pushes:
                push.cancel()
            destinations.release(req_id)

    async def deliver(self, destinations: Destinations, part: EncodePart, frames: list[Any]) -> None:
        if part.embedding_port is None:
            await self.to_ranks(destinations, part.req_id, frames)
            return
        ports = part.embedding_port if isinstance(part.embedding_port, list) else [part.embedding_port]
        await asyncio.gather(*(self.push(_host_port(part.prefill_host, port), frames) for port in ports))


def _error(failure: Failure, req_id: Any) -> JSONResponse:
    """SGLang's encoder's error body, with the status of the error taxonomy."""
    return JSONResponse({"status": "error", "message": failure.message, "req_id": req_id},
                        status_code=failure.rule.http)


def _req_id(body: Any) -> Any:
    return body.get("req_id") if isinstance(body, Mapping) else None


def _probe_png() -> bytes:
    """32x32 random pixels (SGLang probes with a 32x32 PNG): never an embedding-cache hit."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _frames(part: EncodePart, embeddings: list[ImageEmbedding]) -> list[Any]:
    rows = torch.cat([e.rows for e in embeddings]).to(ROW_DTYPE)
    return part_frames(part.req_id, part.num_parts, part.part_idx, rows, [e.grid_thw for e in embeddings],
                       [e.orig_size for e in embeddings])


async def _encoded(ticket: Ticket, engine: Engine, part: EncodePart, fetcher: ImageFetcher) -> list[Any]:
    """The part's images through the engine, as the message SGLang's receiver takes: the chat
    route's order (the image count, then every image fetched, then a work slot)."""
    engine.check_image_count(len(part.items))
    data = await fetcher.fetch_all(part.items)  # not holding a work slot
    images = [ImageInput(item_bytes, where=item.where) for item_bytes, item in zip(data, part.items, strict=True)]
    async with ticket.work():
        embeddings = await engine.embed(images)
        return await engine.run_cpu(_frames, part, embeddings)


def add_sglang_routes(app: FastAPI, admission: Admission, read_json: JsonReader,
                      fetcher: FetcherOf) -> Callable[[], None]:
    """Serve SGLang's encoder routes on `app`; every request is admitted like the face's others,
    and its images fetched by the face's `fetcher`. Returns the routes' close (once the server
    stopped serving): the error reports still under way are cancelled, the ZMQ context destroyed."""
    destinations = Destinations()
    pusher = Pusher()
    background: set[asyncio.Task[None]] = set()

    def reported(task: asyncio.Task[None]) -> None:
        background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not push an encode error to the language side: %s",
                        failure_for(task.exception()).message)

    def report(part: EncodePart, message: str, status: int) -> None:
        """Push the failure to the part's destination too, without holding the answer back."""
        task = asyncio.create_task(pusher.deliver(destinations, part, error_frames(
            part.req_id, part.num_parts, part.part_idx, message, status)))
        background.add(task)
        task.add_done_callback(reported)

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            part = parse_encode_request(body)
        except Exception as exc:  # noqa: BLE001 - a refused request has no destination to be told
            return _error(failure_for(exc), _req_id(body))
        async with contextlib.AsyncExitStack() as stack:
            try:
                ticket = await stack.enter_async_context(admission.enter())
                engine = admission.engine  # set once the server serves, which admission checked
                frames = await _encoded(ticket, engine, part, fetcher(engine))
            except Exception as exc:  # noqa: BLE001 - every failure is the part's error, on both channels
                failure = failure_for(exc)
                report(part, failure.message, failure.rule.http)
                return _error(failure, part.req_id)
            # The place (not the work slot) is kept while the rows travel: a drain waits for the
            # push, and the pushes in flight (each holding a part's rows) count against the capacity.
            try:
                await pusher.deliver(destinations, part, frames)
            except Exception as exc:  # noqa: BLE001 - a push that did not happen is this request's error
                return _error(failure_for(exc), part.req_id)
        return JSONResponse(None)

    @app.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            destinations.register(*parse_registration(body))
        except Exception as exc:  # noqa: BLE001 - the taxonomy's status, SGLang's error body
            return _error(failure_for(exc), _req_id(body))
        return JSONResponse(None)

    refusal = failure_for(Unsupported(_MOONCAKE))

    async def mooncake(request: Request) -> Response:
        """Refused; a waiting `/encode` of the part ends with the same error at once."""
        body = None
        with contextlib.suppress(Exception):  # the refusal does not depend on the body
            body = await read_json(request)
        if isinstance(req_id := _req_id(body), str):
            destinations.refuse(req_id, refusal.message)
        return _error(refusal, _req_id(body))

    app.post("/send")(mooncake)
    app.post("/scheduler_receive_meta_data")(mooncake)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's: a probe through the whole engine, unless requests are at work (then they are the
        proof, and the probe stays off the workers), as SGLang's encoder does."""
        if admission.serving and admission.working:
            return Response(status_code=200)
        try:
            async with admission.admit() as engine:
                await engine.embed([ImageInput(_probe_png())])
        except Exception as exc:  # noqa: BLE001 - any failure is unhealthy (the reason goes to the log)
            log.warning("health_generate: %s", failure_for(exc).message)
            return Response(status_code=503)
        return Response(status_code=200)

    def close() -> None:
        for task in list(background):
            task.cancel()
        pusher.close()

    return close
