"""The serving process: one `Engine`, the state and admission every request passes, and the faces
it starts as peers: the gRPC face (`service.rpc`, always), the OpenAI-compatible HTTP face
(`service.http`, with an HTTP port), the plaintext health port and `/metrics`. Neither face knows
the other or this module; both reach the engine only through `Admission`.

Lifecycle: `start()` binds every port and answers health NOT_SERVING while the engine loads and
warms up in the background; then SERVING, following the encoder pool (NOT_SERVING while no worker
is ready). `drain()` (SIGTERM) flips health to NOT_SERVING for good (open Watch streams get it and
end), refuses new requests with UNAVAILABLE, lets admitted ones finish (up to a grace period) and
stops; an idle server stops at once, whatever streams are open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.admission import Admission, State
from service.engine import Engine, EngineConfig
from service.epd.destinations import DestinationRule, Guard
from service.epd.membership import Membership, MembershipConfig
from service.epd.sglang_encoder import SglangEncoder
from service.http.app import HttpConfig, create_app, one_fetcher
from service.http.server import HttpServer
from service.metrics import Metrics, MetricsServer
from service.rpc.server import SERVICE_NAME, GrpcConfig, GrpcFace

log = logging.getLogger("kimi_vision.server")

# Once no admitted request is left, what the rest (a status being sent, a health check) may take.
STOP_GRACE_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    """Where the process listens and how much work it takes. What an image or a request may hold
    is the engine's (`EngineConfig`); what a message may hold, each face's."""

    host: str = "127.0.0.1"
    port: int = 50051  # the gRPC face (0 = any free port; see VisionServer.port)
    http_port: int | None = None  # the OpenAI-compatible HTTP face (None: off; 0: any free port)
    # SGLang's encoder routes on a listener of their own (None: on http_port; 0: any free port)
    epd_port: int | None = None
    epd_host: str | None = None  # where epd_port listens (None: host)
    # Where SGLang's pushes may go, from either face (--epd-allowed-destinations; default: the caller's address).
    epd_destinations: DestinationRule = field(default_factory=DestinationRule.parse)
    health_port: int | None = None  # the gRPC health service alone, plaintext (None: off; 0: any)
    metrics_port: int | None = None  # /metrics (None: off; 0: any free port)
    max_concurrency: int = 4  # requests doing work at once, over both faces
    max_queue: int = 32  # requests waiting for a slot; more are refused (overloaded)
    max_bodies_in_flight: int = 8  # HTTP request bodies being read at once (the rest wait in the queue)
    drain_grace_s: float = 30.0
    log_health_checks: bool = False  # an access-log line for every health check too (both faces)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)  # the rosters it joins once serving


class VisionServer:
    """One serving process around one `Engine`. Create and use it on a running event loop."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig | None = None, *,
                 engine: Engine | None = None, metrics: Metrics | None = None) -> None:
        if (engine_config is None) == (engine is None):
            raise ValueError("give either engine_config (the server loads it) or a loaded engine")
        self.config = config
        self._engine_config = engine_config
        self._loaded = engine
        self._owns_engine = engine is None
        self.metrics = metrics or (engine.metrics if engine is not None else Metrics())
        self.admission = Admission(config.max_concurrency, config.max_queue, self.metrics,
                                   bodies=config.max_bodies_in_flight)
        self._fetcher = one_fetcher(config.http)  # one for every listener and SGLang's encoder on each face
        # SGLang's encoder, one for both faces: one registration table, one budget of pushes.
        self.sglang = SglangEncoder(self.admission, self._fetcher, Guard(config.epd_destinations,
                                                                         self.listening_ports))
        self.grpc = GrpcFace(self.admission, self.metrics, config.grpc, log_health_checks=config.log_health_checks,
                             sglang=self.sglang)
        self.http: HttpServer | None = None
        self.epd: HttpServer | None = None
        self.port: int | None = None
        self.http_port: int | None = None
        self.epd_port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.load_error: BaseException | None = None
        self._metrics_server: MetricsServer | None = None
        self._warm_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._membership: Membership | None = None
        self._stopped = asyncio.Event()

    @property
    def engine(self) -> Engine | None:
        """The engine, once loaded (None while it loads, and after the server stopped it)."""
        return self._loaded

    def listening_ports(self) -> set[int]:
        """Every port this server listens on (known once each is bound): never a push destination."""
        return {port for port in (self.port, self.http_port, self.epd_port, self.health_port, self.metrics_port)
                if port}

    @property
    def _pushing(self) -> bool:
        """Whether SGLang's pushes (from either face) are still under way."""
        return self.sglang.busy

    @property
    def draining(self) -> bool:
        return self.admission.state == State.DRAINING

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind every port and start serving (health NOT_SERVING until the engine is warm).
        Returns the gRPC port."""
        cfg = self.config
        self.port = await self.grpc.start(cfg.host, cfg.port)
        if cfg.health_port is not None:
            self.health_port = await self.grpc.start_health_port(cfg.host, cfg.health_port)
        certfile, keyfile = cfg.http.tls_files or (None, None)
        fetcher = self._fetcher
        if cfg.http_port is not None:
            app = create_app(self.admission, self.metrics, cfg.http, log_health_checks=cfg.log_health_checks,
                             sglang=self.sglang if cfg.epd_port is None else None, fetcher=fetcher)
            self.http = HttpServer(app, cfg.host, cfg.http_port, certfile=certfile, keyfile=keyfile)
            self.http_port = self.http.port
            await self.http.start()
        if cfg.epd_port is not None:
            app = create_app(self.admission, self.metrics, cfg.http, log_health_checks=cfg.log_health_checks,
                             openai=False, sglang=self.sglang, fetcher=fetcher)
            self.epd = HttpServer(app, cfg.epd_host or cfg.host, cfg.epd_port, certfile=certfile, keyfile=keyfile)
            self.epd_port = self.epd.port
            await self.epd.start()
        if cfg.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry)
            self.metrics_port = await self._metrics_server.start(cfg.host, cfg.metrics_port)
        if cfg.membership.joins:  # joined once serving (`_warm`); its URLs name the ports just bound
            self._membership = Membership(cfg.membership, http_port=self.http_port, epd_port=self.epd_port,
                                          scheme="https" if certfile else "http",
                                          serving=lambda: self.admission.serving)
        self._warm_task = asyncio.create_task(self._warm())
        return self.port

    async def _warm(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            engine = self._loaded
            if engine is None:
                engine = self._loaded = await loop.run_in_executor(None, Engine.load, self._engine_config,
                                                                   self.metrics)
            await loop.run_in_executor(None, engine.warmup)
        except Exception as exc:  # noqa: BLE001 - reported by wait_ready / serve
            self.load_error = exc
            self.admission.state = State.FAILED
            log.error("engine failed to load: %s", exc)
            self._stopped.set()
            return
        self.metrics.read_workers(engine.health)
        if not self.draining:
            self.admission.engine = engine
            await self._set_state(State.SERVING)
            log.info("serving %s on %s:%s", SERVICE_NAME, self.config.host, self.port)
            self._watch_task = asyncio.create_task(self._watch_pool(engine))
            if self._membership is not None:
                self._membership.start()

    async def _set_state(self, state: State) -> None:
        self.admission.state = state
        await self.grpc.set_serving(state == State.SERVING)

    async def _watch_pool(self, engine: Engine, period_s: float = 1.0) -> None:
        """Health follows the encoder pool: NOT_SERVING while no worker is ready (e.g. the only one
        died and is restarting), SERVING again once one is."""
        while not self.draining:
            await asyncio.sleep(period_s)
            now = State.SERVING if engine.serving else State.NO_WORKER
            if now != self.admission.state and not self.draining:
                log.warning("encoder pool %s", "ready again" if now == State.SERVING else "has no ready worker")
                await self._set_state(now)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until warm; raises the load error if the engine could not be loaded."""
        await asyncio.wait_for(asyncio.shield(self._warm_task), timeout)
        if self.load_error is not None:
            raise self.load_error

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop taking work, let admitted requests finish (up to the grace period), then stop.

        Admitted requests and the pushes of rows still under way (SGLang's, which hold no place) are
        waited for: open health Watch streams end at once (NOT_SERVING is their last message), and
        whatever else is open gets `STOP_GRACE_S`."""
        if self.draining:
            await self._stopped.wait()
            return
        self.admission.state = State.DRAINING
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        log.info("draining: health NOT_SERVING, new requests refused, %d in flight, grace %.0f s",
                 self.admission.admitted, grace)
        deadline = time.monotonic() + grace  # the leave below is within it
        # Off the rosters first (bounded), so no proxy sends more while the admitted work finishes.
        await asyncio.gather(self.grpc.shut_down_health(), *([self._membership.leave()] if self._membership else []))
        while (self.admission.admitted or self._pushing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop(grace=STOP_GRACE_S)

    async def stop(self, grace: float | None = 0) -> None:
        if self._membership is not None:
            await self._membership.close()
        for server in (self.http, self.epd):
            if server is not None:
                await server.stop()
        await self.grpc.stop(grace)
        self.sglang.close()  # no face serves it now: its sockets, the error reports still under way
        if self._metrics_server is not None:
            await self._metrics_server.close()
            self._metrics_server = None
        for task in (self._warm_task, self._watch_task):
            if task is not None and not task.done():
                task.cancel()
        if self._owns_engine and self._loaded is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._loaded.close)
            self._loaded = self.admission.engine = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


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

        with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=...)) as handle:
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the server's loop; the future gives its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    @property
    def target(self) -> str:
        return f"{self.server.config.host}:{self.port}"

    @property
    def engine(self) -> Engine | None:
        return self.server.engine

    def wait_ready(self) -> ServerThread:
        self._run(self.server.wait_ready(self._ready_timeout_s))
        return self

    def drain(self, grace_s: float | None = None) -> None:
        self._run(self.server.drain(grace_s))

    def stop(self) -> None:
        if self.loop.is_running():
            self._run(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
