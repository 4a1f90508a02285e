"""SGLang 0.5.23's ZMQ transports (`zmq_to_tokenizer`, `zmq_to_scheduler`) from the encoder's
side: a part's rows pushed over ZMQ PUSH as SGLang's receiver reads them (`sglang_wire`), to the
port the request names or to each scheduler rank that registers the part.

Where to, the request says: `embedding_port` an int is `zmq_to_tokenizer` (push to
`prefill_host:embedding_port`); None is `zmq_to_scheduler` (push to every scheduler rank that
registers the part, once `receive_count` have); a list of ports pushes to each at `prefill_host`.
Every address is checked by `destinations.Guard` before it reaches here (`Target` holds only
checked addresses). A failure is pushed there too, as SGLang's error `EmbeddingData`, so the
language side fails the request at once instead of waiting for its timeout. SGLang's `mooncake`
(RDMA) backend is not served (`MOONCAKE_REFUSAL`): a rank asking for it ends its part's wait.

What the transport holds is bounded, whatever callers send: the registered parts (`MAX_PARTS`,
each expiring after REGISTRATION_TIMEOUT_S unless its `/encode` is delivering it; a part's ranks
register from the host of its first registrant), the sockets of result pushes (`MAX_PUSHES`: more
is 503) and of error reports (`MAX_ERROR_PUSHES`: more is dropped, and logged), and each push's
time (SEND_TIMEOUT_S, ERROR_SEND_TIMEOUT_S). A part waiting for its ranks holds one place of its
budget too, so the parts whose rows are held are bounded by the same number.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from service.engine import Encoding, Engine
from service.epd.base import Delivery, Sink
from service.epd.destinations import IP, Address, Guard
from service.epd.sglang_wire import ROW_DTYPE, error_frames, part_frames
from service.errors import BadRequest, DeadlineExceeded, Failure, Unavailable, Unsupported, failure_for
from vision.media import Modality

log = logging.getLogger("kimi_vision.sglang")

# SGLang's own bounds (SGLANG_ENCODER_SEND_TIMEOUT, SGLANG_ENCODER_REQ_TIMEOUT: 180 s by default):
# how long a push may take, and how long a part waits for its scheduler ranks to register.
SEND_TIMEOUT_S = 180.0
REGISTRATION_TIMEOUT_S = 180.0
# An error report is a few hundred bytes a listening receiver takes at once; one to a peer that does
# not take it within this is given up, so failing requests cannot keep sockets for minutes.
ERROR_SEND_TIMEOUT_S = 30.0
# What a request may name: a part's id, its part count, the ports of one part, its ranks.
MAX_REQ_ID_BYTES = 256
MAX_NUM_PARTS = 1024
MAX_PORTS = 64
MAX_RECEIVE_COUNT = 256
# What the transport holds at once, over all requests.
MAX_PARTS = 4096  # registered parts (zmq_to_scheduler), each a few hundred bytes
MAX_PUSHES = 256  # sockets pushing rows (each part in flight holds its rows once, whatever its ports)
MAX_ERROR_PUSHES = 64  # sockets pushing error reports
DROPS_LOGGED_EVERY_S = 10.0  # dropped error reports are logged as a count, at most this often
# How often a push looks whether its frames have left: from the first pause, doubling, up to the longest.
FIRST_POLL_S, LONGEST_POLL_S = 0.001, 0.05
# After the frames have left ZMQ's hands, how long a closed socket may still flush its last bytes.
FLUSH_LINGER_MS = 1000
MOONCAKE_REFUSAL = ("the mooncake (RDMA) transfer backend is not served by this encoder; run the SGLang language "
                    "server with --encoder-transfer-backend zmq_to_scheduler or zmq_to_tokenizer")
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class Part:
    """One part of a language-side request's items."""

    req_id: str
    num_parts: int
    part_idx: int
    modality: Modality


@dataclass(frozen=True)
class Target:
    """A part and where its rows go: checked addresses (zmq_to_tokenizer, or a list of ports), or
    None for the scheduler ranks that register it (zmq_to_scheduler)."""

    part: Part
    addresses: tuple[Address, ...] | None


@dataclass
class Registration:
    """Where a `zmq_to_scheduler` part goes, as its scheduler ranks register it."""

    born: float = field(default_factory=time.monotonic)
    host: IP | None = None  # the first registrant's address: the part's other ranks register from it too
    expected: int | None = None  # receive_count: the ranks that will register (the TP size)
    urls: list[Address] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False  # its /encode is delivering it
    refused: str | None = None  # a rank asked for what is not served (mooncake)


class Destinations:
    """The scheduler ranks registered per part (`req_id`), kept until its `/encode` delivered it; a
    registration whose `/encode` never comes is dropped after REGISTRATION_TIMEOUT_S. At most
    MAX_PARTS at once; kept in the order they were made, so expiring is a look at the oldest."""

    def __init__(self) -> None:
        self._parts: OrderedDict[str, Registration] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def _expire(self) -> None:
        now = time.monotonic()
        for _ in range(len(self._parts)):
            req_id, part = next(iter(self._parts.items()))
            if now - part.born <= REGISTRATION_TIMEOUT_S:
                return
            if part.claimed:  # its /encode releases it when its own deadline ends
                self._parts.move_to_end(req_id)
            else:
                del self._parts[req_id]

    def get(self, req_id: str) -> Registration:
        self._expire()
        part = self._parts.get(req_id)
        if part is None:
            if len(self._parts) >= MAX_PARTS:
                raise Unavailable(f"{MAX_PARTS} parts are registered and waiting for their /encode; retry shortly")
            part = self._parts[req_id] = Registration()
        return part

    def register(self, req_id: str, count: int, url: Address, host: IP | None) -> None:
        part = self.get(req_id)
        if part.host is not None and part.host != host:
            raise BadRequest(f"req_id={req_id} is registered from another host ({part.host}); the ranks of a part "
                             "register from one host")
        if part.expected is not None and part.expected != count:
            raise BadRequest(f"Inconsistent receive_count for req_id={req_id}: registered {part.expected}, got {count}")
        if url not in part.urls:
            if len(part.urls) >= count:
                raise BadRequest(f"req_id={req_id}: all {count} of its ranks registered already")
            part.urls.append(url)
        part.host, part.expected = host, count
        part.changed.set()

    def refuse(self, req_id: str, message: str, host: IP | None) -> None:
        part = self.get(req_id)
        if part.host is not None and part.host != host:
            return  # a stranger cannot end another host's part
        part.refused = message
        part.changed.set()

    def release(self, req_id: str) -> None:
        self._parts.pop(req_id, None)


class Budget:
    """At most `limit` things at once (sockets, reports), taken all at once or not at all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, count: int = 1) -> bool:
        if self.used + count > self.limit:
            return False
        self.used += count
        return True

    @contextlib.contextmanager
    def hold(self, count: int, what: str) -> Iterator[None]:
        """`count` of them for the block, or Unavailable (retryable) naming `what` is full."""
        if not self.take(count):
            raise Unavailable(f"{what}: all {self.limit} are in use ({count} needed); retry shortly")
        try:
            yield
        finally:
            self.used -= count


async def _sent(tracker: zmq.MessageTracker) -> None:
    """Until ZMQ is done with the tracked frames: looked at from the event loop, so a slow peer
    holds no thread (the default executor also resolves hosts and loads the engine)."""
    pause = FIRST_POLL_S
    while not tracker.done:
        await asyncio.sleep(pause)
        pause = min(2 * pause, LONGEST_POLL_S)


class Pusher:
    """ZMQ PUSH to the language side, as SGLang's encoder sends: connect, send the frames (waiting
    for the peer, `IMMEDIATE`), let the socket flush them, close. A push that does not finish in
    its time is given up and its socket closed at once (nothing lingers)."""

    def __init__(self) -> None:
        self._context: zmq.asyncio.Context | None = None

    def close(self) -> None:
        """Close every socket at once (what is still queued is dropped: the server is stopping)."""
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def push(self, address: Address, frames: list[Any], timeout_s: float) -> None:
        sock = None
        sent = False
        try:
            if self._context is None:
                self._context = zmq.asyncio.Context()
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.IPV6, int(address.ip.version == 6))
            async with asyncio.timeout(timeout_s):
                sock.connect(address.url)
                await _sent(await sock.send_multipart(frames, copy=False, track=True))
            sent = True
        except TimeoutError:
            raise Unavailable(f"cannot push to {address}: not taken within {timeout_s:g} s") from None
        except zmq.ZMQError as exc:
            busy = "; retry shortly" if exc.errno in _EXHAUSTED else ""
            raise Unavailable(f"cannot push to {address}: {exc.strerror}{busy}") from None
        finally:
            if sock is not None:
                sock.close(linger=FLUSH_LINGER_MS if sent else 0)

    async def to_ranks(self, destinations: Destinations, req_id: str, frames: list[Any], budget: Budget,
                       timeout_s: float) -> None:
        """Push to each scheduler rank of the part as it registers, until `receive_count` have."""
        part = destinations.get(req_id)
        if part.claimed:
            raise BadRequest(f"req_id={req_id} is being delivered by another /encode already")
        part.claimed = True
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        pushes: list[asyncio.Task[None]] = []
        try:
            while True:
                if part.refused is not None:
                    raise Unsupported(part.refused)
                pushes += [asyncio.create_task(self._held(budget, url, frames, timeout_s))
                           for url in part.urls[len(pushes):]]
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

    async def _held(self, budget: Budget, address: Address, frames: list[Any], timeout_s: float) -> None:
        with budget.hold(1, "the push sockets"):
            await self.push(address, frames, timeout_s)

    async def deliver(self, destinations: Destinations, target: Target, frames: list[Any], budget: Budget,
                      timeout_s: float) -> None:
        if target.addresses is None:
            with budget.hold(1, "the push sockets"):
                await self.to_ranks(destinations, target.part.req_id, frames, budget, timeout_s)
            return
        with budget.hold(len(target.addresses), "the push sockets"):
            await asyncio.gather(*(self.push(address, frames, timeout_s) for address in target.addresses))


def _frames(part: Part, encoding: Encoding) -> list[Any]:
    rows = torch.cat([e.rows for e in encoding.embeddings]).to(ROW_DTYPE)
    return part_frames(part.req_id, part.num_parts, part.part_idx, part.modality, rows,
                       [e.grid_thw for e in encoding.embeddings], [e.orig_size for e in encoding.embeddings])


class SglangZmqSink(Sink):
    """Parts pushed as SGLang's receiver takes them; the scheduler ranks' registrations kept until
    their part is delivered; failures reported on the same channel, in the background. Every
    destination was checked by `guard` first.

    A result push runs as a task of its own (`send`): the request waiting for it may go (its
    client left) and the push still ends within its budget and time; a drain waits for those
    (`busy`)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.destinations = Destinations()
        self._pusher = Pusher()
        self._results = Budget(MAX_PUSHES)
        self._errors = Budget(MAX_ERROR_PUSHES)
        self._pushes: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._dropped = 0  # error reports dropped since the last line that said so
        self._drops_logged = -DROPS_LOGGED_EVERY_S

    async def frames(self, engine: Engine, encoding: Encoding, part: Part) -> list[Any]:
        """The part's message, built off the event loop."""
        return await engine.run_cpu(_frames, part, encoding)

    async def send(self, target: Target, frames: list[Any]) -> None:
        """Push the message; the push goes on when this is cancelled (the waiting client left)."""
        task = asyncio.create_task(self._pusher.deliver(self.destinations, target, frames, self._results,
                                                        SEND_TIMEOUT_S))
        self._pushes.add(task)
        task.add_done_callback(self._pushed)
        await asyncio.shield(task)

    async def deliver(self, engine: Engine, encoding: Encoding, destination: Target | None = None) -> Delivery:
        assert destination is not None, "an SGLang part says where it goes"
        await self.send(destination, await self.frames(engine, encoding, destination.part))
        return Delivery({}, [])

    @property
    def busy(self) -> bool:
        return bool(self._pushes)

    def report(self, target: Target, failure: Failure) -> None:
        """Push the part's failure to its destination too, without holding the answer back (dropped,
        and counted in the log, when the error budget is spent)."""
        part = target.part
        needed = 1 if target.addresses is None else len(target.addresses)
        if self._errors.used + needed > self._errors.limit:
            self._drop()
            return
        frames = error_frames(part.req_id, part.num_parts, part.part_idx, part.modality, failure.message,
                              failure.rule.http)
        task = asyncio.create_task(self._pusher.deliver(self.destinations, target, frames, self._errors,
                                                        ERROR_SEND_TIMEOUT_S))
        self._background.add(task)
        task.add_done_callback(lambda done: self._reported(done, part.req_id))

    def register(self, req_id: str, count: int, url: Address, host: IP | None) -> None:
        self.destinations.register(req_id, count, url, host)

    def refuse_mooncake(self, req_id: str | None, host: IP | None) -> Failure:
        """The mooncake refusal; a waiting part of `req_id` (registered from `host`) ends with it at once."""
        failure = failure_for(Unsupported(MOONCAKE_REFUSAL))
        if req_id is not None:
            with contextlib.suppress(Unavailable):  # the table is full: the refusal is still answered
                self.destinations.refuse(req_id, failure.message, host)
        return failure

    def close(self) -> None:
        for task in [*self._background, *self._pushes]:
            task.cancel()
        self._pusher.close()

    def _pushed(self, task: asyncio.Task[None]) -> None:
        self._pushes.discard(task)
        if not task.cancelled():
            task.exception()  # its waiting request (if still there) answered it

    def _reported(self, task: asyncio.Task[None], req_id: str) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not push the encode error of %s to the language side: %s", req_id,
                        failure_for(task.exception()).message)

    def _drop(self) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._drops_logged >= DROPS_LOGGED_EVERY_S:
            log.warning("%d encode error reports to the language side dropped: all %d error push sockets are in "
                        "use", self._dropped, MAX_ERROR_PUSHES)
            self._dropped, self._drops_logged = 0, now
