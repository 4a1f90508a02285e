"""SGLang 0.5.23's ZMQ transports (`zmq_to_tokenizer`, `zmq_to_scheduler`) from the encoder's
side: a part's rows pushed over ZMQ PUSH as SGLang's receiver reads them (`sglang_wire`), to the
port the request names or to each scheduler rank that registers the part.

Where to, the part says: `embedding_port` an int is `zmq_to_tokenizer` (push to
`prefill_host:embedding_port`); None is `zmq_to_scheduler` (push to every scheduler rank that
registers the part, once `receive_count` have); a list of ports pushes to each at `prefill_host`.
A failure is pushed there too, as SGLang's error `EmbeddingData`, so the language side fails the
request at once instead of waiting for its timeout. SGLang's `mooncake` (RDMA) backend is not
served (`MOONCAKE_REFUSAL`): a rank asking for it ends its part's wait with that error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from service.engine import Encoding, Engine
from service.epd.base import Delivery, Sink
from service.epd.sglang_wire import ROW_DTYPE, error_frames, part_frames
from service.errors import BadRequest, DeadlineExceeded, Failure, Unavailable, Unsupported, failure_for
from vision.media import Modality

log = logging.getLogger("kimi_vision.sglang")

# SGLang's own bounds (SGLANG_ENCODER_SEND_TIMEOUT, SGLANG_ENCODER_REQ_TIMEOUT: 180 s by default):
# how long a push may take, and how long a part waits for its scheduler ranks to register.
SEND_TIMEOUT_S = 180.0
REGISTRATION_TIMEOUT_S = 180.0
# How often a push looks whether its frames have left: from the first pause, doubling, up to the longest.
FIRST_POLL_S, LONGEST_POLL_S = 0.001, 0.05
MOONCAKE_REFUSAL = ("the mooncake (RDMA) transfer backend is not served by this encoder; run the SGLang language "
                    "server with --encoder-transfer-backend zmq_to_scheduler or zmq_to_tokenizer")


@dataclass(frozen=True)
class Part:
    """One part of a language-side request's items, and where its rows go."""

    req_id: str
    num_parts: int
    part_idx: int
    modality: Modality
    prefill_host: str | None
    embedding_port: int | list[int] | None  # int: zmq_to_tokenizer; None: zmq_to_scheduler; list: direct


def _host_port(host: str, port: int) -> str:
    """SGLang's `NetworkAddress.to_host_port_str`: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class Registration:
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
        self._parts: dict[str, Registration] = {}

    def get(self, req_id: str) -> Registration:
        now = time.monotonic()
        for stale in [key for key, part in self._parts.items()
                      if not part.claimed and now - part.born > REGISTRATION_TIMEOUT_S]:
            del self._parts[stale]
        return self._parts.setdefault(req_id, Registration())

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

    async def deliver(self, destinations: Destinations, part: Part, frames: list[Any]) -> None:
        if part.embedding_port is None:
            await self.to_ranks(destinations, part.req_id, frames)
            return
        ports = part.embedding_port if isinstance(part.embedding_port, list) else [part.embedding_port]
        await asyncio.gather(*(self.push(_host_port(part.prefill_host, port), frames) for port in ports))


def _frames(part: Part, encoding: Encoding) -> list[Any]:
    rows = torch.cat([e.rows for e in encoding.embeddings]).to(ROW_DTYPE)
    return part_frames(part.req_id, part.num_parts, part.part_idx, part.modality, rows,
                       [e.grid_thw for e in encoding.embeddings], [e.orig_size for e in encoding.embeddings])


class SglangZmqSink(Sink):
    """Parts pushed as SGLang's receiver takes them; the scheduler ranks' registrations kept until
    their part is delivered; failures reported on the same channel, in the background."""

    def __init__(self) -> None:
        self.destinations = Destinations()
        self._pusher = Pusher()
        self._background: set[asyncio.Task[None]] = set()

    async def deliver(self, engine: Engine, encoding: Encoding, destination: Part | None = None) -> Delivery:
        assert destination is not None, "an SGLang part says where it goes"
        frames = await engine.run_cpu(_frames, destination, encoding)
        await self._pusher.deliver(self.destinations, destination, frames)
        return Delivery({}, [])

    def report(self, part: Part, failure: Failure) -> None:
        """Push the part's failure to its destination too, without holding the answer back."""
        frames = error_frames(part.req_id, part.num_parts, part.part_idx, part.modality, failure.message,
                              failure.rule.http)
        task = asyncio.create_task(self._pusher.deliver(self.destinations, part, frames))
        self._background.add(task)
        task.add_done_callback(self._reported)

    def register(self, req_id: str, count: int, url: str) -> None:
        self.destinations.register(req_id, count, url)

    def refuse_mooncake(self, req_id: str | None) -> Failure:
        """The mooncake refusal; a waiting part of `req_id` ends with it at once."""
        failure = failure_for(Unsupported(MOONCAKE_REFUSAL))
        if req_id is not None:
            self.destinations.refuse(req_id, failure.message)
        return failure

    def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        self._pusher.close()

    def _reported(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not push an encode error to the language side: %s",
                        failure_for(task.exception()).message)
