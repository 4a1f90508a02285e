"""Admission: what every request of every face passes before it works. The serving process's state
(warming up, serving, draining, failed) decides whether a request is taken at all; then a bounded
queue stands in front of a fixed number of work slots. A request over capacity is refused at once
(`Overloaded`), never parked. The faces (`service.rpc`, `service.http`) only read this; the server
(`service.server`) sets the state and the engine.

A generation counts against the capacity (slots + queue: every admitted request, for overload and
for the drain) but takes no work slot: the trunk's scheduler runs generations together, up to
`--max-num-seqs` at once within the KV-cache budget, the others waiting in its queue. The slots
(`--max-concurrency`) bound the image work of everything else: Preprocess, CountTokens, Embed,
Encode, and the chat completions that only encode (vLLM's EC producer priming).
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


class Admission:
    """`slots` requests work at once; up to `queue` more wait for a slot; anything more is refused.

    `admit()` yields the engine: the faces reach it only through admission."""

    def __init__(self, slots: int, queue: int, metrics: Metrics) -> None:
        if slots < 1 or queue < 0:
            raise ValueError("need at least one slot and a non-negative queue")
        self.capacity = slots + queue
        self._slots = asyncio.Semaphore(slots)
        self._metrics = metrics
        self.state = State.WARMING
        self.engine: Engine | None = None  # set by the server once loaded
        self.admitted = 0  # waiting + working
        self.working = 0

    @property
    def serving(self) -> bool:
        """What health reports, on every face."""
        return self.state == State.SERVING

    @contextlib.asynccontextmanager
    async def admit(self, *, generation: bool = False) -> AsyncIterator[Engine]:
        refusal = _REFUSALS.get(self.state)
        if refusal is not None:
            raise Unavailable(refusal)
        if self.admitted >= self.capacity:
            raise Overloaded(f"server is at capacity ({self.capacity} requests admitted); retry with backoff")
        self.admitted += 1
        if generation:
            try:
                yield self.engine
            finally:
                self.admitted -= 1
            return
        self._metrics.queue_depth.inc()
        try:
            try:
                await self._slots.acquire()
            finally:
                self._metrics.queue_depth.dec()
            self.working += 1
            self._metrics.inflight.inc()
            try:
                yield self.engine
            finally:
                self.working -= 1
                self._metrics.inflight.dec()
                self._slots.release()
        finally:
            self.admitted -= 1
