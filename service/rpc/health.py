"""`grpc.health.v1.Health` whose Watch streams end when the server drains.

grpcio-health-checking's servicer keeps every Watch open until the server stops, and a server
stops only when its grace period runs out while an RPC is open: one load balancer watching health
stretched every SIGTERM to the whole drain grace (30 s) and then ended the Watch CANCELLED. Here
`shut_down()` sets every service NOT_SERVING for good, each open Watch sends that and returns (the
stream ends OK), so the watcher learns at once and an idle server exits at once.

Check and Watch answer as the protocol says: Check an unknown service NOT_FOUND; Watch an unknown
service SERVICE_UNKNOWN, then follows it. A slow watcher only delays its own stream: no lock is
held while a status is written.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Create on the server's event loop; `set` and `shut_down` from it too."""

    def __init__(self) -> None:
        self._status: dict[str, Status] = {}
        self._changed = asyncio.Condition()
        self._shut_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        service, sent = request.service, None
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
