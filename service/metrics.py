"""Prometheus metrics for the service, kept in a registry of their own, served on `/metrics` of
the metrics port from the server's event loop (`MetricsServer`) and of the HTTP face (`render` is
the scrape itself, for any HTTP server).

A private registry (not the process-global default) lets several servers live in one process
(tests, the demo) without clashing names; the process and platform collectors are registered in
it too, so a scrape carries `process_resident_memory_bytes`, open fds, CPU seconds and Python's GC.

Names follow the conventions dashboards already know:

- gRPC as go-grpc-prometheus names it (`grpc_server_started_total`, `grpc_server_handled_total`,
  `grpc_server_handling_seconds`, labelled `grpc_type`, `grpc_service`, `grpc_method` and, once
  handled, `grpc_code` spelled as Go spells status codes: `OK`, `InvalidArgument`, `Canceled`).
- HTTP as Prometheus' own client libraries name it (`http_requests_total` by `method`, `handler`,
  `code`; `http_request_duration_seconds`).
- The service's own under `kimi_vision_`: tokens, the embedding cache, admission (queue depth,
  requests in flight), encoder workers (ready, restarts, images, busy seconds: what an autoscaler
  scales an encoder fleet on) and images refused by reason.
- The trunk's as vLLM 0.33.0 names them, with its labels (`model_name`: the first served name;
  `engine`: "0", this server's one engine) and its default buckets, where the meaning is the
  same, so a dashboard made for vLLM reads them: `vllm:num_requests_running` and
  `vllm:num_requests_waiting` (sequences, a request's n counting as n, as vLLM's n child requests),
  `vllm:kv_cache_usage_perc` (0..1), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds` (each from the generation's start in the engine).
"""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlparse

import grpc
import h11
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted

# Seconds; covers header-only CountTokens (sub-ms) up to long Generate streams.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # one trunk step
GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# The HTTP `method` label's values: any other method a caller makes up counts as "other" (label
# values come from fixed sets, or a scraper's series grow with whatever the internet sends).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER_METHOD = "other"
METRICS_PATH = "/metrics"
# The metrics port's connections: each request must arrive whole within IDLE_TIMEOUT_S of the
# connection's start or its last answer (Prometheus scrapes every 15 s or more and reconnects), and
# at most MAX_CONNECTIONS are open at once (one more closes the one idle longest, so a flood of idle
# connections cannot keep a scraper out). A request head is at most MAX_HEAD_BYTES.
IDLE_TIMEOUT_S = 10.0
# vLLM 0.33.0's series (vllm/v1/metrics/loggers.py) and their default buckets (vllm/v1/metrics/buckets.py).
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
MAX_CONNECTIONS = 128
MAX_HEAD_BYTES = 16 << 10


def go_code(code: grpc.StatusCode) -> str:
    """A status code as Go's `codes.Code.String()` spells it, which is what `grpc_code` holds in the
    go-grpc-prometheus convention: OK, Canceled, InvalidArgument, DeadlineExceeded, ..."""
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    if code == grpc.StatusCode.OK:
        return "OK"
    return "".join(word.capitalize() for word in code.name.split("_"))


class _EncoderWorkers:
    """A collector read at scrape time from the engine's pool (`Engine.health`): how many encoder
    workers are ready, and each worker's restarts, images and busy seconds. Until an engine is
    attached it reports nothing."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, Any]] | None = None

    def describe(self) -> list[Metric]:
        return []  # names are not known before the first scrape; nothing here can clash

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        workers = self.source()["workers"]
        ready = GaugeMetricFamily("kimi_vision_encoder_workers_ready", "Encoder workers ready for images.")
        ready.add_metric([], sum(1 for w in workers if w["ready"]))
        restarts = CounterMetricFamily("kimi_vision_encoder_worker_restarts",
                                       "Encoder worker restarts (after a crash or kill) by worker.",
                                       labels=["worker", "device"])
        # What the tower ran: an image served from a cache or the shared store is not counted here.
        images = CounterMetricFamily("kimi_vision_encoder_images",
                                     "Images an encoder worker answered (its tower ran), by worker.",
                                     labels=["worker", "device"])
        # What an autoscaler reads: its rate over a window is the share of that window the worker
        # was busy, exact whenever it is scraped (a gauge of "busy now" flips with each image).
        busy = CounterMetricFamily("kimi_vision_encoder_busy_seconds",
                                   "Seconds an encoder worker held an image it had not answered yet, by worker.",
                                   labels=["worker", "device"])
        for w in workers:
            restarts.add_metric([str(w["index"]), w["device"]], w["restarts"])
            images.add_metric([str(w["index"]), w["device"]], w["answered"])
            busy.add_metric([str(w["index"]), w["device"]], w["busy_seconds"])
        yield ready
        yield restarts
        yield images
        yield busy


class TrunkLoad(NamedTuple):
    """The trunk's scheduler as a scrape reads it."""

    running: int  # sequences decoding or having their prompt prefilled
    waiting: int  # sequences not yet admitted
    kv_cache_usage: float  # 0..1 of the KV budget


class _Trunk:
    """vLLM's scheduler gauges, read at scrape time from the engine (`Engine.trunk_load`); nothing
    until an engine with a trunk is attached."""

    def __init__(self) -> None:
        self.source: Callable[[], TrunkLoad] | None = None
        self.model_name = ""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        load = self.source()
        for name, text, value in (
                ("vllm:num_requests_running", "Trunk sequences admitted: decoding or prefilling.", load.running),
                ("vllm:num_requests_waiting", "Trunk sequences queued, preempted ones too.", load.waiting),
                ("vllm:kv_cache_usage_perc", "Share of the KV pool's blocks in use, 0 to 1.", load.kv_cache_usage)):
            gauge = GaugeMetricFamily(name, text, labels=VLLM_LABELS)
            gauge.add_metric([self.model_name, VLLM_ENGINE], value)
            yield gauge


class VllmSeries(NamedTuple):
    """vLLM's per-request series, bound to one model's labels (`Metrics.vllm_series`)."""

    prompt_tokens: Counter
    generation_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.grpc_started = Counter("grpc_server_started", "RPCs started on the server.", GRPC_LABELS, registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed on the server, whatever their status.",
                                    (*GRPC_LABELS, "grpc_code"), registry=r)
        self.grpc_seconds = Histogram("grpc_server_handling_seconds",
                                      "Time from the start of an RPC to its status, on the server.", GRPC_LABELS,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter("http_requests", "HTTP requests answered, by method, route and status.",
                                     ("method", "handler", "code"), registry=r)
        self.http_seconds = Histogram("http_request_duration_seconds",
                                      "Time to answer an HTTP request (a stream: until its response starts).",
                                      ("method", "handler"), buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("kimi_vision_queue_depth", "Admitted requests waiting for a slot.", registry=r)
        self.inflight = Gauge("kimi_vision_inflight_requests", "Requests holding a slot.", registry=r)
        self.tokens = Counter(
            "kimi_vision_tokens", "Tokens handled: image (embedding rows), prompt, generated.", ["kind"], registry=r
        )
        self.cache_lookups = Counter(
            "kimi_vision_embed_cache_lookups", "Embedding cache lookups by result.", ["result"], registry=r
        )
        self.cache_bytes = Gauge("kimi_vision_embed_cache_bytes", "Bytes held by the embedding cache.", registry=r)
        self.running_sequences = Gauge("kimi_vision_running_sequences", "Sequences decoding in the trunk's batch.",
                                       registry=r)
        self.waiting_generations = Gauge("kimi_vision_waiting_generations",
                                         "Generations (and preempted sequences) waiting for the trunk or being "
                                         "prefilled.", registry=r)
        self.kv_cache_blocks_total = Gauge("kimi_vision_kv_cache_blocks_total",
                                           "Blocks of the trunk's KV cache pool (16 tokens of every MLA layer each).",
                                           registry=r)
        self.kv_cache_blocks_used = Gauge("kimi_vision_kv_cache_blocks_used",
                                          "Blocks of the KV cache pool held by sequences.", registry=r)
        self.kv_cache_used_bytes = Gauge("kimi_vision_kv_cache_used_bytes",
                                         "Bytes of the KV cache pool held by sequences (blocks used x block size).",
                                         registry=r)
        self.kv_cache_allocated_bytes = Gauge("kimi_vision_kv_cache_allocated_bytes",
                                              "Bytes the KV cache pool's storage takes (a GPU's: the pool from the "
                                              "start; a CPU's grows with the blocks taken).", registry=r)
        self.kv_cache_preemptions = Counter("kimi_vision_kv_cache_preemptions",
                                            "Sequences preempted (blocks freed, prefilled again later) when the KV "
                                            "cache pool ran out.", registry=r)
        self.trunk_step_seconds = Histogram("kimi_vision_trunk_step_seconds",
                                            "Time of one trunk forward with its sampling (one engine step).",
                                            buckets=STEP_BUCKETS, registry=r)
        self.images_refused = Counter("kimi_vision_images_refused",
                                      "Images refused, by reason (the error kind: bad_input, too_large, unsupported).",
                                      ["reason"], registry=r)
        self.store_lookups = Counter("kimi_vision_ec_store_lookups",
                                     "Encoder-cache store lookups before an encode, by result (hit: the rows were "
                                     "served from the store, the tower did not run).", ["result"], registry=r)
        self.store_lease_waits = Counter("kimi_vision_ec_store_lease_waits",
                                         "Items waited for because another instance held the store's lease on them.",
                                         registry=r)
        self.store_evictions = Counter("kimi_vision_ec_store_evictions",
                                       "Encoder-cache store entries this instance evicted to keep the budget.",
                                       registry=r)
        self.store_bytes = Gauge("kimi_vision_ec_store_bytes",
                                 "Bytes of the encoder-cache store's entries at this instance's last scan (with "
                                 "--ec-store-max-gb).", registry=r)
        self._workers = _EncoderWorkers()
        r.register(self._workers)
        self._trunk = _Trunk()
        r.register(self._trunk)
        self._vllm = (
            Counter("vllm:prompt_tokens", "Prompt tokens of ended generations (media_pad expanded).", VLLM_LABELS,
                    registry=r),
            Counter("vllm:generation_tokens", "Tokens the generations that ended sampled.", VLLM_LABELS, registry=r),
            Histogram("vllm:time_to_first_token_seconds", "A generation's start in the engine to its first token.",
                      VLLM_LABELS, buckets=VLLM_TTFT_BUCKETS, registry=r),
            Histogram("vllm:inter_token_latency_seconds", "Between one sampled token of a sequence and its next.",
                      VLLM_LABELS, buckets=VLLM_ITL_BUCKETS, registry=r),
            Histogram("vllm:e2e_request_latency_seconds", "From a generation's start in the engine to its end.",
                      VLLM_LABELS, buckets=VLLM_E2E_BUCKETS, registry=r))

    def store_lookup(self, hit: bool) -> None:
        self.store_lookups.labels(result="hit" if hit else "miss").inc()

    def store_lease_wait(self) -> None:
        self.store_lease_waits.inc()

    def store_evicted(self, entries: int, nbytes: int) -> None:
        self.store_evictions.inc(entries)
        self.store_bytes.set(nbytes)

    def read_workers(self, source: Callable[[], dict[str, Any]]) -> None:
        """Report the encoder workers of `source()` (an `Engine.health`) on every scrape."""
        self._workers.source = source

    def vllm_series(self, model_name: str) -> VllmSeries:
        """vLLM's per-request series, labelled for `model_name`."""
        return VllmSeries(*(metric.labels(model_name, VLLM_ENGINE) for metric in self._vllm))

    def read_trunk(self, model_name: str, source: Callable[[], TrunkLoad]) -> None:
        """Report vLLM's scheduler gauges of `source()` (an `Engine.trunk_load`) on every scrape."""
        self._trunk.model_name = model_name
        self._trunk.source = source

    def grpc_start(self, grpc_type: str, service: str, method: str) -> None:
        self.grpc_started.labels(grpc_type, service, method).inc()

    def grpc_end(self, grpc_type: str, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.grpc_handled.labels(grpc_type, service, method, go_code(code)).inc()
        self.grpc_seconds.labels(grpc_type, service, method).observe(seconds)

    def http_end(self, method: str, handler: str, status: int, seconds: float) -> None:
        """`handler`: a route's path (or one fixed word for none), never a path a caller sent."""
        method = method if method in HTTP_METHODS else OTHER_METHOD
        self.http_requests.labels(method, handler, str(status)).inc()
        self.http_seconds.labels(method, handler).observe(seconds)


def render(registry: CollectorRegistry, *, accept: str = "", accept_encoding: str = "",
           query: str = "") -> tuple[list[tuple[str, str]], bytes]:
    """A scrape of `registry` as Prometheus' own handler answers it (text or OpenMetrics by `accept`,
    gzip when accepted, `name[]` filters): its headers and body."""
    names = parse_qs(query).get("name[]")
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry.restricted_registry(names) if names else registry)
    headers = [("Content-Type", content_type)]
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers.append(("Content-Encoding", "gzip"))
    return headers, body


class _Connection(asyncio.Protocol):
    """One client of the metrics port: HTTP/1.1 by h11, answered at once on the event loop. Each
    request (the first one, and each after an answer) must arrive whole within the idle timeout."""

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._request: h11.Request | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._server.opened(self)
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._server.idle_timeout_s, self.close)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server.closed(self)

    def data_received(self, data: bytes) -> None:
        self._http.receive_data(data)
        self._read()

    def eof_received(self) -> bool:
        self._http.receive_data(b"")
        self._read()
        return False  # and close

    def _read(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            try:
                event = self._http.next_event()
            except h11.RemoteProtocolError as exc:
                self._answer(exc.error_status_hint, [], b"malformed HTTP request\n", close=True)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                self.close()
                return
            if isinstance(event, h11.Request):
                self._request = event
            elif isinstance(event, h11.EndOfMessage) and self._request is not None:
                self._respond(self._request)  # a body (none is expected) was read and dropped

    def _respond(self, request: h11.Request) -> None:
        self._request = None
        target = urlparse(request.target.decode("latin-1"))
        method = request.method.decode("latin-1")
        headers: list[tuple[str, str]] = []
        if method not in ("GET", "HEAD"):
            status, headers, body = 405, [("Allow", "GET, HEAD")], f"only GET and HEAD on {METRICS_PATH}\n".encode()
        elif target.path != METRICS_PATH:
            status, body = 404, f"only {METRICS_PATH} is served on this port\n".encode()
        else:
            fields = {name.decode("latin-1"): value.decode("latin-1") for name, value in request.headers}
            status, (headers, body) = 200, render(self._server.registry, accept=fields.get("accept", ""),
                                                  accept_encoding=fields.get("accept-encoding", ""),
                                                  query=target.query)
        self._answer(status, headers, body, head=method == "HEAD")
        if self._http.our_state is h11.DONE and self._http.their_state is h11.DONE:
            self._http.start_next_cycle()
            self._server.used(self)
            self._arm()

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes, *, head: bool = False,
                close: bool = False) -> None:
        """One write (head and body together: the next request need not wait for an ACK); a HEAD
        answer has the length of the body it leaves out."""
        if self._http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            headers = [*headers, ("Content-Length", str(len(body)))]
            if close:
                headers.append(("Connection", "close"))
            events: list[h11.Event] = [h11.Response(status_code=status, headers=headers)]
            if body and not head:
                events.append(h11.Data(data=body))
            self.transport.write(b"".join(self._http.send(event) or b"" for event in (*events, h11.EndOfMessage())))
        if close or self._http.our_state is h11.MUST_CLOSE:
            self.close()


class MetricsServer:
    """`/metrics` of one registry, served from the event loop it is started on: no thread per
    connection. Every connection must send each request whole within `idle_timeout_s` (an idle
    kept-alive one is closed then), and at most `max_connections` are open at once: one more
    closes the one that has waited longest since its last request."""

    def __init__(self, registry: CollectorRegistry, *, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.registry = registry
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._connections: dict[_Connection, None] = {}  # least recently used first
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port} (metrics): {exc.strerror or exc}") from None
        # Answers are one write each, but a client's next request on the connection must not wait
        # for its delayed ACK of the last one (accepted sockets inherit the option on Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server = await asyncio.get_running_loop().create_server(lambda: _Connection(self), sock=sock)
        return sock.getsockname()[1]

    def opened(self, connection: _Connection) -> None:
        if len(self._connections) >= self.max_connections:
            oldest = next(iter(self._connections))
            del self._connections[oldest]  # now: it is only closing, and the next one must not pick it again
            oldest.close()
        self._connections[connection] = None

    def used(self, connection: _Connection) -> None:
        if self._connections.pop(connection, False) is None:  # not if evicted meanwhile
            self._connections[connection] = None

    def closed(self, connection: _Connection) -> None:
        self._connections.pop(connection, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                connection.close()
            await self._server.wait_closed()
            self._server = None
