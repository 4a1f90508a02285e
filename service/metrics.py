"""Prometheus metrics for the service, kept in a registry of their own.

A private registry (not the process-global default) lets several servers live in one process
(tests, the demo) without clashing names; `serve_http` exposes it on `--metrics-port`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Seconds; covers header-only CountTokens (sub-ms) up to long Generate streams.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kimi_vision_requests", "Finished RPCs by method and status code.", ["method", "code"], registry=r
        )
        self.latency = Histogram(
            "kimi_vision_request_seconds", "RPC latency by method.", ["method"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("kimi_vision_queue_depth", "Admitted requests waiting for a slot.", registry=r)
        self.inflight = Gauge("kimi_vision_inflight_requests", "Requests holding a slot.", registry=r)
        self.tokens = Counter(
            "kimi_vision_tokens", "Tokens handled: image (embedding rows), prompt, generated.", ["kind"], registry=r
        )
        self.cache_lookups = Counter(
            "kimi_vision_embed_cache_lookups", "Embedding cache lookups by result.", ["result"], registry=r
        )
        self.cache_bytes = Gauge("kimi_vision_embed_cache_bytes", "Bytes held by the embedding cache.", registry=r)

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method=method, code=code).inc()
        self.latency.labels(method=method).observe(seconds)

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose `/metrics` on a background HTTP server thread."""
        start_http_server(port, addr=addr, registry=self.registry)
