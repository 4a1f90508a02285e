"""The gRPC face: `kimi.vision.v1.VisionService` (`handlers.py`) on grpc.aio, with SGLang's
`sglang.grpc.encoder.SglangEncoder` beside it on the same port (`sglang_encoder.py`, when the
serving process gives it SGLang's encoder), health, reflection and the interceptors (`observe.py`
first, so refused calls are counted and logged too, then the configured ones (the token check),
then the protobuf guard, on every port). The serving process (`service.server`) starts it beside
the HTTP face and tells it the health state; it reaches the engine only through `Admission`.

Every RPC's body runs inside `call`: admission (the serving state, then a work slot; a Generate
takes none, the trunk's scheduler bounds generations), and every
failure becomes a status in one place (`failures`, through `service.errors`), the failure's kind
beside the request id in the trailing metadata. SGLang's RPCs run inside `failures` alone: their
encoder admits them itself, as it does the HTTP routes'. Cancellation (client gone, deadline
passed) cancels the handler task; the engine notices at its next check.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import errors
from service.admission import Admission
from service.engine import Engine
from service.epd.sglang_encoder import SglangEncoder
from service.metrics import Metrics
from service.rpc import MAX_FRAME_BYTES
from service.rpc._proto import vision_pb2 as pb
from service.rpc._proto import vision_pb2_grpc as pb_grpc
from service.rpc.handlers import VisionService
from service.rpc.health import NOT_SERVING, SERVING, HealthServicer
from service.rpc.observe import RpcObserver
from service.rpc.proto_guard import MalformedRequestInterceptor
from service.rpc.sglang_encoder import SGLANG_SERVICE_NAME, SglangEncoderService, add_to_server
from service.rpc.status import abort

# What one client's connections may hold, on both ports. A client queues RPCs beyond the streams
# its connection may have (gRPC's own clients wait; a raw one is refused); Watch streams have their
# own, lower bounds (`health.MAX_WATCHES_PER_CONNECTION`, `health.MAX_WATCHES`).
MAX_STREAMS_PER_CONNECTION = 256  # the main port: more than the admission queue and the trunk's batch
HEALTH_MAX_STREAMS_PER_CONNECTION = 32  # the health port: probes and watchers only
# A peer that vanished without closing (a host gone, a dropped NAT entry) is found by a ping after
# KEEPALIVE_S without traffic and dropped KEEPALIVE_TIMEOUT_S later, with every stream it held.
KEEPALIVE_S = 60
KEEPALIVE_TIMEOUT_S = 20
MAX_IDLE_S = 300  # a connection without any RPC for this long is closed (GOAWAY; clients reconnect)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VisionService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def _connection_options(max_streams: int) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),  # a busy port is an error, not silently shared
        ("grpc.max_concurrent_streams", max_streams),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.max_connection_idle_ms", MAX_IDLE_S * 1000),
    ]


@dataclass(frozen=True)
class GrpcConfig:
    max_receive_bytes: int = 64 << 20  # one request message, all images together
    max_send_bytes: int = 256 << 20  # one response (float32 patches of a huge image are ~160 MB)
    # TLS credentials (None = plaintext) and interceptors that run before every handler (after the
    # observer, before the protobuf guard), in order.
    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()


class GrpcFace:
    """The VisionService (and SGLang's encoder service, given `sglang`), health and reflection on one
    port (plus, optionally, health alone on a plaintext port). Create and use it on the server's
    event loop."""

    def __init__(self, admission: Admission, metrics: Metrics, config: GrpcConfig, *,
                 log_health_checks: bool = False, sglang: SglangEncoder | None = None) -> None:
        self.admission = admission
        self.config = config
        self.sglang = sglang
        self._services = (SERVICE_NAME, *((SGLANG_SERVICE_NAME,) if sglang is not None else ()))
        self.health = HealthServicer()
        self.observer = RpcObserver(metrics, log_health_checks=log_health_checks)
        self._servers: list[grpc.aio.Server] = []

    async def start(self, host: str, port: int) -> int:
        """Serve the VisionService (health NOT_SERVING until told otherwise). Returns the port."""
        cfg = self.config
        interceptors = (self.observer, *cfg.interceptors, MalformedRequestInterceptor())
        server = grpc.aio.server(interceptors=interceptors, options=[
            *_connection_options(MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_receive_message_length", cfg.max_receive_bytes),
            ("grpc.max_send_message_length", cfg.max_send_bytes),
            # A multi-MB image in 4 MiB HTTP/2 frames rather than 16 KiB ones (measured: a 2.5 MB
            # request in about half the time on loopback).
            ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
        ])
        pb_grpc.add_VisionServiceServicer_to_server(VisionService(self.call, cfg.max_receive_bytes), server)
        if self.sglang is not None:
            add_to_server(SglangEncoderService(self.failures, self.sglang), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*self._services, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self.set_serving(False)
        return await self._bind(server, host, port, cfg.credentials)

    async def start_health_port(self, host: str, port: int) -> int:
        """The health service alone, plaintext and without the token (what Kubernetes' gRPC probes
        reach when the main port has TLS or a token). Returns the port."""
        server = grpc.aio.server(interceptors=(self.observer, MalformedRequestInterceptor()),
                                 options=_connection_options(HEALTH_MAX_STREAMS_PER_CONNECTION))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return await self._bind(server, host, port, None)

    async def _bind(self, server: grpc.aio.Server, host: str, port: int,
                    credentials: grpc.ServerCredentials | None) -> int:
        address = f"{host}:{port}"
        try:
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from None
        await server.start()
        self._servers.append(server)
        return bound

    async def set_serving(self, serving: bool) -> None:
        for name in ("", *self._services):
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def shut_down_health(self) -> None:
        """NOT_SERVING for good: open Watch streams get it and end (a drain need not wait for them)."""
        await self.health.shut_down()

    async def stop(self, grace: float | None = 0) -> None:
        for server in self._servers:
            await server.stop(grace)
        self._servers.clear()

    @contextlib.asynccontextmanager
    async def failures(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """The error mapping around one RPC's body (its metrics and log line: the observer)."""
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise errors.DeadlineExceeded("deadline already passed")
            yield
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, in one place
            await abort(context, errors.failure_for(exc))

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext, *, generation: bool = False) -> AsyncIterator[Engine]:
        """Admission and the error mapping around one RPC's body."""
        async with self.failures(context), self.admission.admit(generation=generation) as engine:
            yield engine
