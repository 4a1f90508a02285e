"""SGLang 0.5.23's encoder protocol, whatever face a request comes by: this server as the encoder of
SGLang language servers (`--language-only --encoder-urls`), over HTTP (`service.http.sglang`:
`http://` URLs) and over gRPC (`service.rpc.sglang_encoder`: `grpc://` URLs). Each face maps its
request to the one body shape SGLang's own encoder checks (its HTTP `/encode` JSON; its gRPC
server builds the same dict from `EncodeRequest`) and its answer from what this raises; the rest
is here, once, for both:

- `parse_encode_request`, `parse_registration`: a body checked as SGLang's encoder does
  (`validate_encode_request`), within this encoder's bounds;
- `SglangEncoder.encode`: a part admitted as the chat route is (its place first, the image count,
  its images fetched by the face's one fetcher outside the work slots, then a work slot), every
  destination checked by `--epd-allowed-destinations` before any connection, the rows pushed by
  SGLang's ZMQ transport (`sglang_zmq`); a failure, once the destination is known, is pushed
  there too as SGLang's error `EmbeddingData`; the place given back before the push;
- `SglangEncoder.register`: a scheduler rank's address for a part (`zmq_to_scheduler`), into the
  one registration table of the server, so a part registered by gRPC can be encoded by HTTP and
  the other way round;
- `SglangEncoder.refuse_mooncake`: the RDMA backend is not served; a waiting part ends at once.

One `SglangEncoder` per server process (`service.server`), given to every face that serves SGLang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from service.admission import Admission, Ticket
from service.engine import Encoding, Engine
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
from service.media import MediaRef, image_url

T = TypeVar("T")
# The item fields SGLang's language side adds to an image's {"url", "detail"}: `content_hash` only names it.
ITEM_IDS = ("content_hash",)
FetcherOf = Callable[[Engine], MediaFetcher]  # the face's one fetcher (made with the engine's per-item limit)
# How a face waits on something long (an encode, a push): HTTP races it against its client leaving;
# gRPC has the call's task cancelled instead, so it waits as is.
Watch = Callable[[Awaitable[Any]], Awaitable[Any]]


async def _as_is(answer: Awaitable[T]) -> T:
    return await answer


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _within_bound(req_id: str) -> bool:
    return len(req_id.encode("utf-8", "surrogatepass")) <= MAX_REQ_ID_BYTES


def echoed_req_id(body: Any) -> str | None:
    """The body's req_id as an answer or a report may echo it (not one over the bound)."""
    req_id = body.get("req_id") if isinstance(body, Mapping) else None
    return req_id if isinstance(req_id, str) and _within_bound(req_id) else None


def _req_id_of(fields: Mapping) -> str:
    req_id = fields.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise BadRequest("missing or invalid req_id")
    if not _within_bound(req_id):
        raise BadRequest(f"req_id is over {MAX_REQ_ID_BYTES} bytes")
    return req_id


def parse_encode_request(body: Any) -> tuple[Part, Named | None, list[MediaRef]]:
    """Check an encode body as SGLang's encoder does (`validate_encode_request`), within this
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
    """A scheduler rank's registration `{req_id, receive_count, receive_url}`: the part, how many
    ranks will register it, this rank's address as named."""
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


async def _encoded(ticket: Ticket, engine: Engine, refs: list[MediaRef], fetcher: MediaFetcher) -> Encoding:
    """The part's items through the engine: the chat route's order (the check, then every item
    fetched, then a work slot)."""
    checked = engine.check(refs)
    data = await fetcher.fetch_all(refs)  # not holding a work slot
    media = [ref.input(item) for ref, item in zip(refs, data, strict=True)]
    async with ticket.work():
        return await engine.encode(await engine.prepare(checked, media))


class SglangEncoder:
    """SGLang's encoder on one server's admission: every request admitted like the faces' others,
    its items fetched by `fetcher`, and every destination checked by `guard` before any connection.
    `sink` is the ZMQ transport (its sockets, its registration table), which the server closes once
    every face stopped serving and whose pushes a drain waits for (`busy`)."""

    def __init__(self, admission: Admission, fetcher: FetcherOf, guard: Guard) -> None:
        self.admission = admission
        self.fetcher = fetcher
        self.guard = guard
        self.sink = SglangZmqSink(guard)

    @property
    def busy(self) -> bool:
        return self.sink.busy

    def close(self) -> None:
        self.sink.close()

    async def encode(self, body: Any, peer: str | None, watch: Watch = _as_is) -> None:
        """One part, encoded and pushed where the body says; returns once the push is done. `peer`:
        the caller's address (the rule's `peer`). What fails is raised (the face answers it), and,
        once the part's destination is known, reported there too (not when the caller left)."""
        part, named, refs = parse_encode_request(body)
        async with contextlib.AsyncExitStack() as stack:
            target = None
            try:
                ticket = await stack.enter_async_context(self.admission.enter())
                addresses = None if named is None else await self.guard.check(named, peer)
                target = Target(part, addresses)
                engine = self.admission.engine  # set once the server serves, which admission checked
                encoding = await watch(_encoded(ticket, engine, refs, self.fetcher(engine)))
                frames = await self.sink.frames(engine, encoding, part)
            except Exception as exc:
                failure = failure_for(exc)
                if target is not None and failure.kind != Kind.CANCELLED:  # a client gone wants no report
                    self.sink.report(target, failure)
                raise
        # The place is given back before the push: a push waits for the language side (up to
        # SEND_TIMEOUT_S) within the transport's own budget of sockets, never holding capacity the
        # chat route needs; a caller that leaves meanwhile is answered as gone and the push goes on.
        await watch(self.sink.send(target, frames))

    async def register(self, body: Any, peer: str | None) -> None:
        """A scheduler rank's address for a part, checked as an encode's destination; the part's
        other ranks register from the first one's host."""
        req_id, count, named = parse_registration(body)
        (address,) = await self.guard.check(named, peer)
        self.sink.register(req_id, count, address, peer_address(peer))

    def refuse_mooncake(self, body: Any, peer: str | None) -> Failure:
        """The mooncake refusal; a waiting part of the body's req_id (registered from `peer`) ends with it."""
        return self.sink.refuse_mooncake(echoed_req_id(body), peer_address(peer))
