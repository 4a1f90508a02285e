"""The server: `kimi.vision.v1.VisionService` (`handlers.py`) on grpc.aio, plus health,
reflection and metrics, and optionally the OpenAI-compatible HTTP face (`service.http`), around one
`Engine`. Both faces share its serving state, admission slots, limits, token and metrics. With a
health port, the health service alone is also served there in plaintext, with no token (what
Kubernetes' gRPC probes can reach when the main port has TLS or a token).

Request flow: an RPC is admitted (bounded: `max_concurrency` hold a slot, up to `max_queue` wait
for one, anything more is `RESOURCE_EXHAUSTED`), its protobuf is turned into engine inputs
(`convert.py`), and the engine does the work on its executors and encoder pool, so the event loop
only moves bytes. Cancellation (client gone, deadline passed) cancels the handler task; the engine
notices at its next check (queued tower work is dropped, generation stops at the next token).
Every failure becomes a status in one place (`call`, through `service.errors`).

Lifecycle: `start()` binds the port and answers health with NOT_SERVING while the engine loads
and warms up in the background; then SERVING. `drain()` (SIGTERM) flips health to NOT_SERVING
(open Watch streams get it and end), refuses new RPCs with UNAVAILABLE, lets in-flight ones finish
(up to a grace period) and stops; an idle server stops at once, whatever streams are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import errors
from service.admission import Admission
from service.engine import Engine, EngineConfig
from service.http.app import HttpConfig, create_app
from service.http.server import HttpServer
from service.metrics import Metrics, MetricsServer
from service.rpc._proto import vision_pb2 as pb
from service.rpc._proto import vision_pb2_grpc as pb_grpc
from service.rpc.client import MAX_FRAME_BYTES
from service.rpc.handlers import VisionService
from service.rpc.health import NOT_SERVING, SERVING, HealthServicer
from service.rpc.observe import RpcObserver

log = logging.getLogger("kimi_vision.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VisionService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Once no admitted request is left, what the rest (a status being sent, a health check) may take.
STOP_GRACE_S = 1.0


@dataclass
class ServerConfig:
    """The transport's settings. What an image or a request may hold is the engine's (`EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (see VisionServer.port)
    metrics_port: int | None = None  # /metrics on this port (None: off; 0: any free port)
    health_port: int | None = None  # the health service alone, plaintext, on this port (None: off; 0: any)
    log_health_checks: bool = False  # an access-log line for every health check too
    max_receive_bytes: int = 64 << 20  # one request message, all images together
    max_send_bytes: int = 256 << 20  # one response (float32 patches of a huge image are ~160 MB)
    max_concurrency: int = 4  # RPCs doing work at once
    max_queue: int = 32  # RPCs waiting for a slot; more -> RESOURCE_EXHAUSTED
    drain_grace_s: float = 30.0
    # Seams for transport security: TLS credentials (None = plaintext) and interceptors that run
    # before every handler (e.g. authentication), in order.
    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    http_port: int | None = None  # the OpenAI-compatible HTTP face on this port (None: off; 0: any free port)
    http: HttpConfig = HttpConfig()
    tls_files: tuple[str, str] | None = None  # (certificate chain, key) PEM files, for the HTTP face's TLS


# ---------------------------------------------------------------------------------------------
# Server lifecycle


class VisionServer:
    """One grpc.aio server around one `Engine`. Create and use it on a running event loop."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig | None = None, *,
                 engine: Engine | None = None, metrics: Metrics | None = None) -> None:
        if (engine_config is None) == (engine is None):
            raise ValueError("give either engine_config (the server loads it) or a loaded engine")
        self.config = config
        self.engine_config = engine_config
        self.engine: Engine | None = engine
        self._owns_engine = engine is None
        self.metrics = metrics or (engine.metrics if engine is not None else Metrics())
        self.admission = Admission(config.max_concurrency, config.max_queue, self.metrics)
        self.health = HealthServicer()
        self.observer = RpcObserver(self.metrics, log_health_checks=config.log_health_checks)
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.ready = asyncio.Event()
        self.draining = False
        self.load_error: BaseException | None = None
        self.serving = False  # what health says (both faces)
        self.http: HttpServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._warm_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    # -- per-RPC wrapper ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """The serving state, then a work slot: what every request of every face goes through."""
        if self.draining:
            raise errors.Unavailable("server is draining; retry on another instance")
        if self.load_error is not None:
            raise errors.Unavailable("server failed to load its model (see the server log); use another instance")
        if not self.ready.is_set():
            raise errors.Unavailable("server is warming up; retry shortly")
        async with self.admission.slot():
            yield

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """`admit` and the error mapping around one RPC's body (its metrics and log line: `RpcObserver`)."""
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise errors.DeadlineExceeded("deadline already passed")
            async with self.admit():
                yield
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, in one place
            failure = errors.failure_for(exc)
            # The kind too, beside what the call's trailing metadata already holds (its request id):
            # several kinds share a status code, and a batch row reports the kind's HTTP status.
            trailing = (*(context.trailing_metadata() or ()), (errors.KIND_METADATA, failure.kind.value))
            await context.abort(failure.rule.grpc, failure.message, trailing_metadata=trailing)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until the engine is warm). Returns the port."""
        cfg = self.config
        server = grpc.aio.server(interceptors=(self.observer, *cfg.interceptors), options=[
            ("grpc.max_receive_message_length", cfg.max_receive_bytes),
            ("grpc.max_send_message_length", cfg.max_send_bytes),
            ("grpc.so_reuseport", 0),  # a busy port is an error, not silently shared
            # A multi-MB image in 4 MiB HTTP/2 frames rather than 16 KiB ones (measured: a 2.5 MB
            # request in about half the time on loopback). Keep in step with service.client.
            ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
        ])
        pb_grpc.add_VisionServiceServicer_to_server(VisionService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_health(NOT_SERVING)
        self.port = _listen(server, cfg.host, cfg.port, cfg.credentials)
        await server.start()
        self._server = server
        if cfg.health_port is not None:
            probes = grpc.aio.server(interceptors=(self.observer,))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, probes)
            self.health_port = _listen(probes, cfg.host, cfg.health_port, None)
            await probes.start()
            self._health_server = probes
        if cfg.http_port is not None:
            certfile, keyfile = cfg.tls_files or (None, None)
            self.http = HttpServer(create_app(self, cfg.http), cfg.host, cfg.http_port, certfile=certfile,
                                   keyfile=keyfile)
            await self.http.start()
        if cfg.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, cfg.host, cfg.metrics_port)
            self.metrics_port = self._metrics_server.port
        self._warm_task = asyncio.create_task(self._warm())
        return self.port

    async def _set_health(self, status: int) -> None:
        self.serving = status == SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _warm(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.engine is None:
                self.engine = await loop.run_in_executor(None, Engine.load, self.engine_config, self.metrics)
            await loop.run_in_executor(None, self.engine.warmup)
        except Exception as exc:  # noqa: BLE001 - reported by wait_ready / serve
            self.load_error = exc
            log.error("engine failed to load: %s", exc)
            self._stopped.set()
            return
        self.metrics.read_workers(self.engine.health)
        if not self.draining:
            self.ready.set()
            await self._set_health(SERVING)
            log.info("serving %s on %s:%s", SERVICE_NAME, self.config.host, self.port)
            self._watch_task = asyncio.create_task(self._watch_pool())

    async def _watch_pool(self, period_s: float = 1.0) -> None:
        """Health follows the encoder pool: NOT_SERVING while no worker is ready (e.g. the only one
        died and is restarting), SERVING again once one is."""
        serving = True
        while not self.draining:
            await asyncio.sleep(period_s)
            now = self.engine.serving
            if now != serving and not self.draining:
                serving = now
                log.warning("encoder pool %s", "ready again" if now else "has no ready worker")
                await self._set_health(SERVING if now else NOT_SERVING)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until warm; raises the load error if the engine could not be loaded."""
        await asyncio.wait_for(asyncio.shield(self._warm_task), timeout)
        if self.load_error is not None:
            raise self.load_error

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop taking work, let in-flight requests finish (up to the grace period), then stop.

        Only admitted requests are waited for: open health Watch streams end at once (NOT_SERVING
        is their last message), and whatever else is open gets `STOP_GRACE_S`."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        log.info("draining: health NOT_SERVING, new requests refused, %d in flight, grace %.0f s",
                 self.admission.admitted, grace)
        self.serving = False
        await self.health.shut_down()
        deadline = time.monotonic() + grace
        while self.admission.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop(grace=STOP_GRACE_S)

    async def stop(self, grace: float | None = 0) -> None:
        if self.http is not None:
            await self.http.stop()
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(grace)
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        for task in (self._warm_task, self._watch_task):
            if task is not None and not task.done():
                task.cancel()
        if self._owns_engine and self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
            self.engine = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _listen(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    address = f"{host}:{port}"
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from None


async def serve(config: ServerConfig, engine_config: EngineConfig,
                on_ready: Callable[[VisionServer], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT (which drain). Returns the process exit code."""
    server = VisionServer(config, engine_config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    try:
        await server.wait_ready()
    except Exception as exc:  # noqa: BLE001 - a clear message, not a traceback
        log.error("cannot serve: %s", exc)
        await server.stop()
        return 1
    if on_ready is not None:
        on_ready(server)
    await server.wait_stopped()
    return 0


class ServerThread:
    """A `VisionServer` on its own event loop in a background thread (demo, tests, benchmarks).

        with ServerThread(ServerConfig(port=0), EngineConfig()) as handle:
            client = VisionClient(handle.target)
    """

    def __init__(self, config: ServerConfig, engine_config: EngineConfig | None = None, *,
                 engine: Engine | None = None, ready_timeout_s: float = 600.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kimi-vision-server", daemon=True)
        self._thread.start()
        self._ready_timeout_s = ready_timeout_s

        async def build() -> VisionServer:
            return VisionServer(config, engine_config, engine=engine)

        self.server: VisionServer = self._run(build())
        self.port: int = self._run(self.server.start())

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"{self.server.config.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def wait_ready(self) -> ServerThread:
        self._run(self.server.wait_ready(self._ready_timeout_s))
        return self

    def drain(self, grace_s: float | None = None) -> None:
        self._run(self.server.drain(grace_s))

    def drain_in_background(self, grace_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace_s), self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self._run(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
