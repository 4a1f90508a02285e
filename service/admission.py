"""Admission: what every request of every face passes before it works. The serving process's state
(warming up, serving, draining, failed) decides whether a request is taken at all; then a bounded
queue stands in front of a fixed number of work slots. A request over capacity is refused at once
(`Overloaded`), never parked. The faces (`service.rpc`, `service.http`) only read this; the server
(`service.server`) sets the state and the engine.

A request takes its place first (`enter`: the state, then the capacity), and keeps it until it
ends, whatever it waits for: a body slot while the HTTP face reads its body (`Ticket.reading`: a
bounded number of bodies in flight, so what is read at once is bounded whatever the clients send,
and every body read is one of the admitted requests'), its remote images (the fetcher's own
bound), then a work slot (`Ticket.work`, which yields the engine). `admit()` is both at once, for
a request that arrived whole (gRPC).

A generation counts against the capacity (slots + queue: every admitted request, for overload and
for the drain) but takes no work slot (`work(generation=True)`): the trunk's scheduler runs
generations together, up to `--max-num-seqs` at once within the KV-cache budget, the others
waiting in its queue. The slots (`--max-concurrency`) bound the image work of everything else:
Preprocess, CountTokens, Embed, Encode, and the chat completions that only encode (vLLM's EC
producer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from enum import StrEnum

from service.engine import Engine
from service.errors import Overloaded, Unavailable
from service.metrics import Metrics


class State(StrEnum):
    WARMING = "warming"  # the engine loads and warms up: requests are refused (retry shortly)
    SERVING = "serving"
    NO_WORKER = "no_worker"  # no encoder worker is ready (one is restarting): health says so, requests wait
    DRAINING = "draining"  # SIGTERM: in-flight requests finish, new ones are refused
    FAILED = "failed"  # the engine could not load


# Why a request is refused in each state that refuses (retryable: another instance, or later).
_REFUSALS = {
    State.WARMING: "server is warming up; retry shortly",
    State.DRAINING: "server is draining; retry on another instance",
    State.FAILED: "server failed to load its model (see the server log); use another instance",
}


class Ticket:
    """One admitted request's place, from `Admission.enter` until it ends."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.waiting = True  # counted in the queue depth until it works

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """A body slot, while the block reads (and parses) the body."""
        async with self._admission._bodies:
            yield

    @contextlib.asynccontextmanager
    async def work(self, *, generation: bool = False) -> AsyncIterator[Engine]:
        """A work slot: the engine, for as long as the block runs. A generation takes none (the
        trunk's scheduler bounds generations: its batch, its queue, the KV budget)."""
        admission = self._admission
        if generation:
            self._started()
            yield admission.engine
            return
        await admission._slots.acquire()
        self._started()
        admission.working += 1
        admission._metrics.inflight.inc()
        try:
            yield admission.engine
        finally:
            admission.working -= 1
            admission._metrics.inflight.dec()
            admission._slots.release()

    def _started(self) -> None:
        self.waiting = False
        self._admission._metrics.queue_depth.dec()

    def _leave(self) -> None:
        if self.waiting:
            self._admission._metrics.queue_depth.dec()
        self._admission.admitted -= 1


class Admission:
    """`slots` requests work at once; up to `queue` more wait (for a slot, or before it: reading
    their body, fetching their images); anything more is refused. `bodies`: request bodies being
    read at once.

    `admit()` yields the engine: the faces reach it only through admission."""

    def __init__(self, slots: int, queue: int, metrics: Metrics, *, bodies: int | None = None) -> None:
        if slots < 1 or queue < 0 or (bodies is not None and bodies < 1):
            raise ValueError("need at least one slot and one body slot, and a non-negative queue")
        self.capacity = slots + queue
        self._slots = asyncio.Semaphore(slots)
        self._bodies = asyncio.Semaphore(bodies or self.capacity)
        self._metrics = metrics
        self.state = State.WARMING
        self.engine: Engine | None = None  # set by the server once loaded
        self.admitted = 0  # waiting + working
        self.working = 0

    @property
    def serving(self) -> bool:
        """What health reports, on every face."""
        return self.state == State.SERVING

    def refusal(self) -> Unavailable | None:
        """Why the state refuses every request now (warming up, draining, failed to load), or None."""
        message = _REFUSALS.get(self.state)
        return None if message is None else Unavailable(message)

    @contextlib.asynccontextmanager
    async def enter(self) -> AsyncIterator[Ticket]:
        """A place among the `capacity` requests taken, or the refusal (`Unavailable`: the state;
        `Overloaded`: full)."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        if self.admitted >= self.capacity:
            raise Overloaded(f"server is at capacity ({self.capacity} requests admitted); retry with backoff")
        self.admitted += 1
        self._metrics.queue_depth.inc()
        ticket = Ticket(self)
        try:
            yield ticket
        finally:
            ticket._leave()

    @contextlib.asynccontextmanager
    async def admit(self, *, generation: bool = False) -> AsyncIterator[Engine]:
        async with self.enter() as ticket, ticket.work(generation=generation) as engine:
            yield engine
