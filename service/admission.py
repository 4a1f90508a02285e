"""Admission: a bounded queue in front of a fixed number of work slots, shared by every face of
one server process. A request over capacity is refused at once (`Overloaded`), never parked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from service.errors import Overloaded
from service.metrics import Metrics


class Admission:
    """`slots` requests work at once; up to `queue` more wait for a slot; anything more is refused."""

    def __init__(self, slots: int, queue: int, metrics: Metrics) -> None:
        if slots < 1 or queue < 0:
            raise ValueError("need at least one slot and a non-negative queue")
        self.capacity = slots + queue
        self._slots = asyncio.Semaphore(slots)
        self._metrics = metrics
        self.admitted = 0  # waiting + working
        self.working = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.admitted >= self.capacity:
            raise Overloaded(f"server is at capacity ({self.capacity} requests admitted); retry with backoff")
        self.admitted += 1
        self._metrics.queue_depth.inc()
        try:
            try:
                await self._slots.acquire()
            finally:
                self._metrics.queue_depth.dec()
            self.working += 1
            self._metrics.inflight.inc()
            try:
                yield
            finally:
                self.working -= 1
                self._metrics.inflight.dec()
                self._slots.release()
        finally:
            self.admitted -= 1
