"""OpenTelemetry tracing end to end: a real `kimi-vision serve --otlp-endpoint` exporting to a real
OTLP/gRPC receiver (the collector's TraceService from opentelemetry-proto, run here), spans checked
for names, nesting and the caller's W3C trace context. And off by default: one shared no-op."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from images import png
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from serve_process import ServeProcess

from service import tracing
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import VisionClient, user

pytestmark = pytest.mark.timeout(300)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"




class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector's OTLP/gRPC receiver is sent, kept."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802 - the proto's name
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[trace_pb2.Span]:
        return [span for request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    def service_names(self) -> set[str]:
        return {attr.value.string_value for request in self.requests for resource in request.resource_spans
                for attr in resource.resource.attributes if attr.key == "service.name"}


@pytest.fixture()
def collector():
    receiver = Collector()
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


def _attributes(span: trace_pb2.Span) -> dict:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_spans_follow_the_request_through_the_engine(collector, tmp_path) -> None:
    receiver, port = collector
    args = ["--devices", "cpu:1", "--otlp-endpoint", f"http://127.0.0.1:{port}"]
    with ServeProcess.start(args, log_path=tmp_path / "serve.log") as server:
        traceparent = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        with VisionClient(server.target, timeout=120) as client:
            request = pb.EmbedRequest(image=pb.Image(data=png(56, 56, seed=1)))
            list(client.stub.Embed(request, metadata=traceparent, timeout=120))
            events = list(client.generate([user("What is this?", png(56, 56, seed=2))], max_new_tokens=2))
            assert events[-1].finish.usage.completion_tokens == 2
            assert client.health() == "SERVING"
        start = time.monotonic()
        assert server.terminate() == 0  # the exporter sends what it holds at exit, and does not hold it up
        assert time.monotonic() - start < 10
    deadline = time.monotonic() + 10
    while not receiver.spans() and time.monotonic() < deadline:
        time.sleep(0.05)
    spans = receiver.spans()
    by_name: dict[str, list[trace_pb2.Span]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert receiver.service_names() == {"kimi-vision"}
    assert not [name for name in by_name if "Health" in name]  # probes are not traced

    (embed,) = by_name["kimi.vision.v1.VisionService/Embed"]
    assert embed.trace_id.hex() == TRACE_ID and embed.parent_span_id.hex() == PARENT_ID  # the caller's trace
    assert embed.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert _attributes(embed)["rpc.method"] == "Embed" and _attributes(embed)["rpc.grpc.status_code"] == 0
    (generate_rpc,) = by_name["kimi.vision.v1.VisionService/Generate"]
    assert generate_rpc.trace_id.hex() != TRACE_ID and not generate_rpc.parent_span_id  # a trace of its own

    def children(parent: trace_pb2.Span) -> list[str]:
        return sorted(s.name for s in spans if s.parent_span_id == parent.span_id)

    assert children(embed) == ["encode", "preprocess"]
    assert children(generate_rpc) == ["encode", "generate", "preprocess"]
    (generate,) = by_name["generate"]
    assert _attributes(generate)["completion_tokens"] == 2
    for stage in ("preprocess", "encode", "generate"):
        for span in by_name[stage]:
            assert span.start_time_unix_nano >= embed.start_time_unix_nano and span.end_time_unix_nano
            assert span.kind == trace_pb2.Span.SPAN_KIND_INTERNAL


def test_tracing_is_off_by_default() -> None:
    assert not tracing.enabled()
    assert tracing.span("preprocess") is tracing.span("encode", images=2)  # one shared no-op, nothing recorded
    with tracing.span("preprocess") as span:
        assert span is None
