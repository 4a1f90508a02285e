"""`grpc.health.v1.Health` whose Watch streams end when the server drains.

grpcio-health-checking's servicer keeps every Watch open until the server stops, and a server
stops only when its grace period runs out while an RPC is open: one load balancer watching health
stretched every SIGTERM to the whole drain grace (30 s) and then ended the Watch CANCELLED. Here
`shut_down()` sets every service NOT_SERVING for good, each open Watch sends that and returns (the
stream ends OK), so the watcher learns at once and an idle server exits at once.

Check and Watch answer as the protocol says: Check an unknown service NOT_FOUND; Watch an unknown
service SERVICE_UNKNOWN, then follows it. A slow watcher only delays its own stream: no lock is
held while a status is written.

Watch streams are bounded, since each holds a handler (about 25 KB) for as long as its client
keeps it open: `MAX_WATCHES_PER_CONNECTION` on one HTTP/2 connection (a load balancer watches one
or two services per connection) and `MAX_WATCHES` over the whole process (both ports together);
one beyond is RESOURCE_EXHAUSTED, saying which bound. Check is not bounded: it ends at once.
What ended streams held is freed, but glibc keeps such scattered free memory in the process (a
flood of 1,024 left +27 MiB of RSS for good): once `RELEASE_AFTER_WATCHES` have ended, it is handed
back to the kernel `RELEASE_DELAY_S` later (one release for a whole burst).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.engine.allocator import release_freed_memory
from service.errors import Failure, Kind
from service.rpc.status import abort

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
MAX_WATCHES_PER_CONNECTION = 16
MAX_WATCHES = 1024
RELEASE_AFTER_WATCHES = 64  # ended streams worth a release (one watcher reconnecting is not)
RELEASE_DELAY_S = 1.0


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Create on the server's event loop; `set` and `shut_down` from it too."""

    def __init__(self) -> None:
        self._status: dict[str, Status] = {}
        self._changed = asyncio.Condition()
        self._shut_down = False
        self._watches: Counter[str] = Counter()  # open Watch streams by connection (its peer address)
        self._watching = 0
        self._ended = 0  # Watch streams ended since memory was last released
        self._release: asyncio.TimerHandle | None = None

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        connection = context.peer()  # "ipv4:127.0.0.1:40312": one per TCP connection
        if self._watches[connection] >= MAX_WATCHES_PER_CONNECTION:
            await abort(context, Failure(Kind.OVERLOADED, f"too many health Watch streams on this connection (at most "
                                                          f"{MAX_WATCHES_PER_CONNECTION}); end one, or use Check"))
        if self._watching >= MAX_WATCHES:
            await abort(context, Failure(Kind.OVERLOADED, f"too many health Watch streams on this server (at most "
                                                          f"{MAX_WATCHES}); retry later, or use Check"))
        self._watches[connection] += 1
        self._watching += 1
        try:
            await self._follow(request.service, context)
        finally:
            self._watching -= 1
            self._watches[connection] -= 1
            if not self._watches[connection]:
                del self._watches[connection]  # or the table grows by every connection that ever watched
            self._ended += 1
            if self._ended >= RELEASE_AFTER_WATCHES and self._release is None:
                self._release = asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._release_memory)

    def _release_memory(self) -> None:
        self._release, self._ended = None, 0
        asyncio.get_running_loop().run_in_executor(None, release_freed_memory)  # off the loop: it locks each arena

    async def _follow(self, service: str, context: grpc.aio.ServicerContext) -> None:
        sent = None
        while True:
            status = self._status.get(service, SERVICE_UNKNOWN)
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if self._shut_down:
                return  # NOT_SERVING was the last word: the stream ends, the server need not wait for it
            async with self._changed:
                await self._changed.wait_for(lambda last=sent: self._shut_down
                                             or self._status.get(service, SERVICE_UNKNOWN) != last)

    async def set(self, service: str, status: Status) -> None:
        """Set one service's status (ignored once shut down: draining is for good)."""
        if self._shut_down:
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def shut_down(self) -> None:
        """Every service NOT_SERVING for good; every open Watch sends it and ends."""
        async with self._changed:
            self._shut_down = True
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._changed.notify_all()
