"""Optional OpenTelemetry tracing: `kimi-vision serve --otlp-endpoint URL` exports spans over OTLP
(gRPC) for each request and the engine's stages in it: the RPC (or HTTP request), `preprocess`
(image headers, limits and content hashes; Preprocess's pixels), `encode` (an encoder worker:
decode, resize, tower, projector) and `generate` (the trunk: prefill and decoding).

Off by default, and then this module imports nothing of OpenTelemetry (it need not be installed:
the SDK and exporter are the `otel` extra) and `span()` hands back one shared no-op context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

SERVICE_NAME = "kimi-vision"

_NO_SPAN = contextlib.nullcontext()
_tracer: Any = None  # an opentelemetry Tracer once configured; None: tracing is off
_provider: Any = None
_otel: dict[str, Any] = {}  # the OpenTelemetry modules, imported by configure() only


class TracingUnavailable(RuntimeError):
    """--otlp-endpoint was given but OpenTelemetry is not installed."""


def configure(endpoint: str, service_name: str = SERVICE_NAME) -> None:
    """Export spans to the OTLP/gRPC collector at `endpoint` (`http://host:4317`: plaintext)."""
    global _tracer, _provider
    try:  # imported here, not at the top: an optional extra, loaded only when tracing is on
        from opentelemetry import propagate, trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(f"--otlp-endpoint needs OpenTelemetry ({exc.name} is not installed): "
                                 "pip install 'kimi-vision[otel]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _otel.update(trace=trace, propagate=propagate)
    _provider, _tracer = provider, provider.get_tracer("kimi_vision")


def shutdown() -> None:
    """Send the spans still queued and stop exporting (at exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def span(name: str, *, carrier: Mapping[str, str] | None = None, **attributes: Any) -> AbstractContextManager[Any]:
    """A span named `name`, child of the current one, as a context manager yielding it (None when
    tracing is off). `carrier`: a request's headers or metadata, which makes this a server span
    continuing the caller's trace (W3C `traceparent`) when it sent one."""
    if _tracer is None:
        return _NO_SPAN
    return _span(name, carrier, attributes)


@contextlib.contextmanager
def _span(name: str, carrier: Mapping[str, str] | None, attributes: dict[str, Any]) -> Iterator[Any]:
    trace = _otel["trace"]
    if carrier is None:
        context, kind = None, trace.SpanKind.INTERNAL
    else:
        context, kind = _otel["propagate"].extract(carrier), trace.SpanKind.SERVER
    with _tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes) as current:
        yield current
