"""SGLang 0.5.23's encoder disaggregation on the HTTP face: this server as the encoder
(`--encoder-only`) of SGLang language servers (`--language-only --encoder-urls`), on the same port
as the OpenAI API, or on a listener of their own (`--epd-port`; the OpenAI port then serves none).
The routes, fields and answers are those of SGLang's own encoder server
(sglang/srt/disaggregation/encoder/http_server.py and runtime.py):

- `POST /encode` `{req_id, mm_items, modality, num_parts, part_idx, prefill_host, embedding_port, ...}`:
  one part of a request's items (`mm_items`: `data:` URLs, or `http(s)` ones with
  `--allow-remote-images`; a `{"url", "detail", "content_hash"}` item too: the one image-part rule
  of every face, `service.media.image_url`) is embedded by the engine and delivered by SGLang's ZMQ
  transport (`service.epd.sglang_zmq`) as SGLang's receiver reads it.
  It is admitted as the chat route is: its place first, the image count, then its images fetched
  by the face's one fetcher (the same rules: `--allowed-media-domains`, `--media-fetch-timeout`,
  `--max-media-fetches`; all at once, outside the work slots), and only then a work slot.
  Where to, the request says (`embedding_port`: an int, a list, or null for the ranks that register
  it); both backends are served at once, request by request. Every destination is checked by
  `--epd-allowed-destinations` (`service.epd.destinations`) before any connection: one not allowed
  is a 400 naming the rule, and gets no error report either. The answer, after the push: 200
  `null`. The request gives its admission place back once its rows are made: the push runs within
  the transport's own budget of sockets and time (503 when spent), so pushes to a slow language
  side never take capacity from the chat route; a client that leaves during the push is logged
  499 and the push goes on (a drain waits for it, up to its grace).
- `POST /scheduler_receive_url` `{req_id, receive_count, receive_url, modality}`: a scheduler rank
  names where it takes a part (`zmq_to_scheduler`); before or after that part's `/encode` arrives.
  The address is checked as an `/encode`'s; the part's other ranks register from the first one's
  host (another host's registration of it, or its count, is refused).
- `GET /health_generate`: a fresh tiny image through the engine when it is idle (200, else 503); `GET /health` is
  the face's own (200 serving, 503 warming up or draining), which SGLang's encoder registry probes.
- `POST /send`, `POST /scheduler_receive_meta_data`: SGLang's `mooncake` (RDMA) backend, not served:
  a clear error, which also ends a waiting `/encode` of that part at once.

A failure (a bad image, a full server, a bad field, a slow body) is answered at once in SGLang's
body shape by the face's one error renderer (`service.http.errors`: the status the taxonomy gives
on every route), and, once the part's destination is known, also pushed there as SGLang's error
`EmbeddingData`: the language side fails the request then, instead of waiting for its timeout.
These routes take no token: SGLang's language side sends none (serve them on `--epd-port`, facing
only the language servers).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from service.admission import Admission, Ticket
from service.engine import Encoding, Engine, MediaInput
from service.epd.destinations import Guard, Named, peer_address, split_host_port
from service.epd.sglang_wire import MODALITY_NAMES
from service.epd.sglang_zmq import (
    MAX_NUM_PARTS,
    MAX_PORTS,
    MAX_RECEIVE_COUNT,
    MAX_REQ_ID_BYTES,
    Part,
    SglangZmqSink,
    Target,
)
from service.errors import BadRequest, Failure, Kind, Unsupported, failure_for
from service.fetch import MediaFetcher
from service.http.errors import Shape, error_response
from service.http.gone import unless_disconnected
from service.media import MediaRef, image_url

log = logging.getLogger("kimi_vision.sglang")

# The item fields SGLang's language side adds to an image's {"url", "detail"}: `content_hash` only names it.
ITEM_IDS = ("content_hash",)

JsonReader = Callable[[Request], Awaitable[Any]]
FetcherOf = Callable[[Engine], MediaFetcher]  # the face's one fetcher (made with the engine's per-item limit)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _within_bound(req_id: str) -> bool:
    return len(req_id.encode("utf-8", "surrogatepass")) <= MAX_REQ_ID_BYTES


def _req_id_of(fields: Mapping) -> str:
    req_id = fields.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise BadRequest("missing or invalid req_id")
    if not _within_bound(req_id):
        raise BadRequest(f"req_id is over {MAX_REQ_ID_BYTES} bytes")
    return req_id


def parse_encode_request(body: Any) -> tuple[Part, Named | None, list[MediaRef]]:
    """Check a `/encode` body as SGLang's encoder does (`validate_encode_request`), within this
    encoder's bounds: the part, where it goes as named (None: the ranks that register it), and its
    items by the one image-part rule (what the modality is served, the engine's check says)."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"request is not a dict: {type(body).__name__}")
    req_id = _req_id_of(body)
    name = body.get("modality")
    if not isinstance(name, str) or name.upper() not in ("IMAGE", "VIDEO", "AUDIO"):
        raise BadRequest(f"unsupported modality: {name[:100]}" if isinstance(name, str)
                         else "missing or invalid modality")
    modality = MODALITY_NAMES.get(name.upper())
    if modality is None:
        raise Unsupported(f"modality {name} is not supported; Kimi-K3 takes images")
    items = body.get("mm_items")
    items = [items] if isinstance(items, str | Mapping) else items
    if not isinstance(items, list) or not items:
        raise BadRequest("missing or empty mm_items")
    num_parts, part_idx = body.get("num_parts"), body.get("part_idx")
    if not _positive_int(num_parts) or num_parts > MAX_NUM_PARTS:
        raise BadRequest(f"num_parts must be a positive integer up to {MAX_NUM_PARTS}")
    if not isinstance(part_idx, int) or isinstance(part_idx, bool) or not 0 <= part_idx < num_parts:
        raise BadRequest(f"part_idx must be in [0, {num_parts})")
    port = body.get("embedding_port")
    ports = port if isinstance(port, list) else [port] if port is not None else []
    if len(ports) > MAX_PORTS:
        raise BadRequest(f"embedding_port lists {len(ports)} ports; at most {MAX_PORTS}")
    if not all(_positive_int(p) and p < 65536 for p in ports) or (isinstance(port, list) and not port):
        raise BadRequest(f"embedding_port must be a port, a list of ports or null, got {port!r}")
    host = body.get("prefill_host")
    if ports and (not isinstance(host, str) or not host):
        raise BadRequest("prefill_host is needed with an embedding_port")
    media = [MediaRef(image_url(item, f"mm_items[{i}]", item_ids=ITEM_IDS), f"mm_items[{i}]", modality)
             for i, item in enumerate(items)]
    named = Named(host, tuple(dict.fromkeys(ports))) if ports else None
    return Part(req_id, num_parts, part_idx, modality), named, media


def parse_registration(body: Any) -> tuple[str, int, Named]:
    """A `/scheduler_receive_url` body: the part, how many ranks will register it, this rank's
    address as named."""
    fields = body if isinstance(body, Mapping) else {}
    req_id = _req_id_of(fields)
    count, url = fields.get("receive_count"), fields.get("receive_url")
    if not _positive_int(count) or count > MAX_RECEIVE_COUNT:
        raise BadRequest(f"receive_count must be a positive integer up to {MAX_RECEIVE_COUNT}")
    if not isinstance(url, str) or len(url) > 300:
        raise BadRequest("receive_url must be host:port")
    try:
        host, port = split_host_port(url)
    except ValueError:
        host, port = "", None
    if not host or port is None or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"receive_url must be host:port, got {url!r}")
    return req_id, count, Named(host, (int(port),))


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


def _error(failure: Failure, req_id: Any) -> Response:
    return error_response(failure, Shape.SGLANG, req_id)


def _req_id(body: Any) -> str | None:
    """The body's req_id as an answer echoes it (not one over the bound)."""
    req_id = body.get("req_id") if isinstance(body, Mapping) else None
    return req_id if isinstance(req_id, str) and _within_bound(req_id) else None


def _probe_png() -> bytes:
    """32x32 random pixels (SGLang probes with a 32x32 PNG): never an embedding-cache hit."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


async def _encoded(ticket: Ticket, engine: Engine, refs: list[MediaRef], fetcher: MediaFetcher) -> Encoding:
    """The part's items through the engine: the chat route's order (the check, then every item
    fetched, then a work slot)."""
    checked = engine.check(refs)
    data = await fetcher.fetch_all(refs)  # not holding a work slot
    media = [ref.input(item) for ref, item in zip(refs, data, strict=True)]
    async with ticket.work():
        return await engine.encode(await engine.prepare(checked, media))


def add_sglang_routes(app: FastAPI, admission: Admission, read_json: JsonReader, fetcher: FetcherOf,
                      guard: Guard) -> SglangZmqSink:
    """Serve SGLang's encoder routes on `app`; every request is admitted like the face's others,
    its items fetched by the face's `fetcher`, and every destination checked by `guard` before any
    connection. Returns the transport, which the server closes once it stopped serving (its sockets,
    the error reports still under way) and whose pushes a drain waits for."""
    sink = SglangZmqSink(guard)

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            part, named, refs = parse_encode_request(body)
        except Exception as exc:  # noqa: BLE001 - a refused request has no destination to be told
            return _error(failure_for(exc), _req_id(body))
        async with contextlib.AsyncExitStack() as stack:
            target = None
            try:
                ticket = await stack.enter_async_context(admission.enter())
                addresses = None if named is None else await guard.check(named, _peer(request))
                target = Target(part, addresses)
                engine = admission.engine  # set once the server serves, which admission checked
                encoding = await unless_disconnected(request, _encoded(ticket, engine, refs, fetcher(engine)))
                frames = await sink.frames(engine, encoding, part)
            except Exception as exc:  # noqa: BLE001 - every failure is the part's error, on both channels
                failure = failure_for(exc)
                if target is not None and failure.kind != Kind.CANCELLED:  # a client gone wants no report
                    sink.report(target, failure)
                return _error(failure, part.req_id)
        # The place is given back before the push: a push waits for the language side (up to
        # SEND_TIMEOUT_S) within the transport's own budget of sockets, never holding capacity the
        # chat route needs; a client that leaves meanwhile is answered 499 and the push goes on.
        try:
            await unless_disconnected(request, sink.send(target, frames))
        except Exception as exc:  # noqa: BLE001 - a push that did not happen is this request's error
            return _error(failure_for(exc), part.req_id)
        return JSONResponse(None)

    @app.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            req_id, count, named = parse_registration(body)
            (address,) = await guard.check(named, _peer(request))
            sink.register(req_id, count, address, peer_address(_peer(request)))
        except Exception as exc:  # noqa: BLE001 - the taxonomy's status, SGLang's error body
            return _error(failure_for(exc), _req_id(body))
        return JSONResponse(None)

    async def mooncake(request: Request) -> Response:
        """Refused; a waiting `/encode` of the part ends with the same error at once."""
        body = None
        with contextlib.suppress(Exception):  # the refusal does not depend on the body
            body = await read_json(request)
        req_id = _req_id(body)
        return _error(sink.refuse_mooncake(req_id, peer_address(_peer(request))), req_id)

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
                await engine.embed([MediaInput(_probe_png())])
        except Exception as exc:  # noqa: BLE001 - any failure is unhealthy (the reason goes to the log)
            log.warning("health_generate: %s", failure_for(exc).message)
            return Response(status_code=503)
        return Response(status_code=200)

    return sink
