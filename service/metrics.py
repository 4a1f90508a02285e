"""Prometheus metrics for the service, kept in a registry of their own, served on `/metrics` only.

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
  requests in flight), encoder workers (ready, restarts) and images refused by reason.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import grpc
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
from prometheus_client.exposition import MetricsHandler

# Seconds; covers header-only CountTokens (sub-ms) up to long Generate streams.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # one trunk step
GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# The HTTP `method` label's values: any other method a caller makes up counts as "other" (label
# values come from fixed sets, or a scraper's series grow with whatever the internet sends).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER_METHOD = "other"
METRICS_PATH = "/metrics"


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
    workers are ready, and each worker's restarts. Until an engine is attached it reports nothing."""

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
        for w in workers:
            restarts.add_metric([str(w["index"]), w["device"]], w["restarts"])
        yield ready
        yield restarts


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
        self._workers = _EncoderWorkers()
        r.register(self._workers)

    def read_workers(self, source: Callable[[], dict[str, Any]]) -> None:
        """Report the encoder workers of `source()` (an `Engine.health`) on every scrape."""
        self._workers.source = source

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


class _MetricsOnly(MetricsHandler):
    """prometheus_client's handler (content negotiation, `name[]` filters, gzip), on `/metrics`
    alone: any other path is 404, so an HTTP probe pointed at this port cannot pass by mistake."""

    def do_GET(self) -> None:
        if urlparse(self.path).path != METRICS_PATH:
            self.send_error(404, f"only {METRICS_PATH} is served on this port")
            return
        super().do_GET()


class MetricsServer:
    """`/metrics` of one registry on a background HTTP server thread; `close()` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server_class = type("_Server", (http.server.ThreadingHTTPServer,),
                            {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        handler = type("_Handler", (_MetricsOnly,), {"registry": registry})
        try:
            self._server = server_class((host, port), handler)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port} (metrics): {exc.strerror or exc}") from None
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kimi-vision-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
