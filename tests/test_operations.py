"""What an operator's tooling meets, through one real `kimi-vision serve` run as production would:
TLS and a bearer token on the main port, the plaintext health port for probes, `/metrics` scraped
and parsed by Prometheus' own client parser, JSON logs read line by line, request ids from gRPC
metadata and HTTP headers, and (last, on the same process) SIGTERM with health Watch streams open.
"""

from __future__ import annotations

import json
import re
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import httpx
import pytest
from certificates import self_signed
from grpc_health.v1 import health_pb2, health_pb2_grpc
from images import png
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess

from service.auth import ENV_VAR
from service.rpc._proto import vision_pb2 as pb
from service.rpc._proto import vision_pb2_grpc as pb_grpc
from service.rpc.auth import auth_metadata, bearer_credentials
from service.rpc.client import image

TOKEN = "operations-test-token-0123456789"
SERVICE = "kimi.vision.v1.VisionService"
pytestmark = pytest.mark.timeout(300)




@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ops")
    cert, key = self_signed(d, "server")
    return {"cert": cert, "key": key, "dir": d}


@pytest.fixture(scope="module")
def server(tls: dict[str, Path]):
    args = ["--devices", "cpu:1", "--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"]), "--health-port", "0",
            "--metrics-port", "0", "--http-port", "0", "--log-format", "json", "--drain-seconds", "30"]
    with ServeProcess.start(args, log_path=tls["dir"] / "serve.log", env={ENV_VAR: TOKEN}) as proc:
        yield proc


@pytest.fixture(scope="module")
def channel(server: ServeProcess, tls: dict[str, Path]):
    """TLS + token: what a real client of this server uses."""
    credentials = bearer_credentials(TOKEN, root_certificates=tls["cert"].read_bytes())
    with grpc.secure_channel(server.target, credentials) as ch:
        yield ch


@pytest.fixture(scope="module")
def probe_channel(server: ServeProcess):
    """Plaintext, no token: what Kubernetes' gRPC probe does."""
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
        yield ch


def _https(server: ServeProcess, tls: dict[str, Path]) -> httpx.Client:
    """The HTTP face, which serves TLS with the same certificate as the main port."""
    return httpx.Client(base_url=f"https://127.0.0.1:{server.http_port}", timeout=30,
                        verify=ssl.create_default_context(cafile=str(tls["cert"])))


def _scrape(server: ServeProcess, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{path}", timeout=10).read().decode()


def _samples(text: str) -> dict[str, list]:
    """Every sample by name, from Prometheus' own parser of the exposition format."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(samples: dict[str, list], name: str, **labels: str) -> float | None:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _log_records(server: ServeProcess) -> list[dict]:
    """Every line of the server's log as a JSON object (a line that is not JSON fails the test)."""
    records = []
    for number, line in enumerate(server.log_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"log line {number} is not JSON: {line!r}")
    return records


# ---------------------------------------------------------------------------------------------
# The health port


def test_plaintext_health_port_with_tls_and_token_on_the_main_port(server, probe_channel) -> None:
    health = health_pb2_grpc.HealthStub(probe_channel)
    for service in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    unknown.cancel()
    # Health alone: the service itself is not there, with or without a token.
    stub = pb_grpc.VisionServiceStub(probe_channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.CountTokens(pb.CountTokensRequest(image=image(png(56, 56))), metadata=auth_metadata(TOKEN), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The main port still takes TLS only: a plaintext probe there cannot reach health.
    with grpc.insecure_channel(server.target) as plaintext:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------------------------------
# Metrics


def test_metrics_by_convention_on_metrics_only(server, channel, tls) -> None:
    stub = pb_grpc.VisionServiceStub(channel)
    assert stub.CountTokens(pb.CountTokensRequest(image=image(png(56, 56, seed=1))), timeout=60).num_tokens == 4
    with pytest.raises(grpc.RpcError):
        stub.CountTokens(pb.CountTokensRequest(image=image(b"not an image")), timeout=60)
    with grpc.secure_channel(server.target, grpc.ssl_channel_credentials(tls["cert"].read_bytes())) as anon:
        with pytest.raises(grpc.RpcError) as info:
            request = pb.CountTokensRequest(image=image(png(56, 56, seed=1)))
            pb_grpc.VisionServiceStub(anon).CountTokens(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    list(stub.Embed(pb.EmbedRequest(image=image(png(56, 56, seed=2))), timeout=60))
    with _https(server, tls) as http:
        assert http.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert http.get("/no/such/path").status_code == 404

    samples = _samples(_scrape(server))
    # The process collectors of the private registry.
    assert _value(samples, "process_resident_memory_bytes") > 50 << 20
    assert _value(samples, "process_open_fds") > 0
    assert _value(samples, "python_info") == 1
    # gRPC, as go-grpc-prometheus names and labels it.
    unary = {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "CountTokens"}
    assert _value(samples, "grpc_server_started_total", **unary) == 3
    assert _value(samples, "grpc_server_handled_total", **unary, grpc_code="OK") == 1
    assert _value(samples, "grpc_server_handled_total", **unary, grpc_code="InvalidArgument") == 1
    assert _value(samples, "grpc_server_handled_total", **unary, grpc_code="Unauthenticated") == 1
    assert _value(samples, "grpc_server_handling_seconds_count", **unary) == 3
    assert _value(samples, "grpc_server_handling_seconds_bucket", **unary, le="+Inf") == 3
    stream = {"grpc_type": "server_stream", "grpc_service": SERVICE, "grpc_method": "Embed"}
    assert _value(samples, "grpc_server_handled_total", **stream, grpc_code="OK") == 1
    # HTTP, by route.
    assert _value(samples, "http_requests_total", method="GET", handler="/v1/models", code="200") == 1
    assert _value(samples, "http_requests_total", method="GET", handler="unmatched", code="404") == 1
    # The service's own.
    assert _value(samples, "kimi_vision_images_refused_total", reason="bad_input") == 1
    assert _value(samples, "kimi_vision_encoder_workers_ready") == 1
    assert _value(samples, "kimi_vision_encoder_worker_restarts_total", worker="0", device="cpu") == 0
    assert _value(samples, "kimi_vision_tokens_total", kind="image") >= 4
    assert _value(samples, "kimi_vision_queue_depth") == 0

    for path in ("/", "/healthz", "/health", "/v1/models", "/metricsx"):
        with pytest.raises(urllib.error.HTTPError) as info:
            _scrape(server, path)
        assert info.value.code == 404, path


# ---------------------------------------------------------------------------------------------
# Logs and request ids


def test_json_logs_carry_the_callers_request_id(server, channel, probe_channel, tls) -> None:
    stub = pb_grpc.VisionServiceStub(channel)
    reply, call = stub.CountTokens.with_call(pb.CountTokensRequest(image=image(png(56, 56, seed=3))),
                                             metadata=(("x-request-id", "ops-req-0001"),), timeout=60)
    assert reply.num_tokens == 4 and ("x-request-id", "ops-req-0001") in call.trailing_metadata()
    with pytest.raises(grpc.RpcError) as info:  # a refused call carries its id back too
        stub.Preprocess(pb.PreprocessRequest(image=image(b"\x89PNG broken")), metadata=(("x-request-id", "ops-bad-2"),),
                        timeout=60)
    assert ("x-request-id", "ops-bad-2") in info.value.trailing_metadata()
    _, call = stub.CountTokens.with_call(pb.CountTokensRequest(image=image(png(56, 56, seed=3))), timeout=60)
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    _, call = stub.CountTokens.with_call(pb.CountTokensRequest(image=image(png(56, 56, seed=3))),
                                         metadata=(("x-request-id", "x" * 500),), timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", dict(call.trailing_metadata())["x-request-id"])  # too long: replaced
    health = health_pb2_grpc.HealthStub(probe_channel)
    for _ in range(5):
        health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    with _https(server, tls) as http:
        response = http.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}", "x-request-id": "ops-http-3"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "ops-http-3"
        assert re.fullmatch(r"[0-9a-f]{32}", http.get("/health").headers["x-request-id"])

    deadline = time.monotonic() + 10  # the log is written by a thread of its own
    while "ops-http-3" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    records = _log_records(server)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    by_id = {r["request_id"]: r for r in records if r["logger"] == "kimi_vision.access" and "request_id" in r}
    ok = by_id["ops-req-0001"]
    assert ok["method"] == f"/{SERVICE}/CountTokens" and ok["status"] == "OK" and ok["level"] == "INFO"
    assert ok["peer"].startswith("ipv4:127.0.0.1:") and ok["duration_ms"] > 0
    assert ok["request_bytes"] > 0 and ok["response_bytes"] > 0
    assert by_id["ops-bad-2"]["status"] == "INVALID_ARGUMENT"
    assert by_id[generated]["method"] == f"/{SERVICE}/CountTokens"
    http_line = by_id["ops-http-3"]
    assert http_line["method"] == "GET /v1/models" and http_line["status"] == "200"
    # Health checks (gRPC and HTTP) are counted but not logged by default.
    assert not [r for r in records if "Health/" in r.get("method", "") or r.get("method") == "GET /health"]
    assert TOKEN not in server.log_text()


# ---------------------------------------------------------------------------------------------
# SIGTERM with Watch streams open (last: it stops the module's server)


def test_sigterm_ends_watch_streams_and_an_idle_server_exits_within_5_s(server, channel, probe_channel) -> None:
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    watches = {"health port": health_pb2_grpc.HealthStub(probe_channel).Watch(request),
               "main port": health_pb2_grpc.HealthStub(channel).Watch(request),
               "main port, server": health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())}
    seen: dict[str, list[int]] = {name: [] for name in watches}
    ended: dict[str, grpc.StatusCode] = {}

    def follow(name: str) -> None:
        try:
            for message in watches[name]:
                seen[name].append(message.status)
            ended[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            ended[name] = exc.code()

    readers = [threading.Thread(target=follow, args=(name,), daemon=True) for name in watches]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 30
    while not all(seen.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(s == [health_pb2.HealthCheckResponse.SERVING] for s in seen.values()), seen

    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    took = time.monotonic() - start
    for reader in readers:
        reader.join(10)
    print(f"\nidle server with 3 health Watch streams open: exit {took:.2f} s after SIGTERM")
    assert code == 0, server.log_text()[-3000:]
    assert took < 5.0, f"exited {took:.1f} s after SIGTERM"
    # Each Watch heard NOT_SERVING and then ended cleanly (not cancelled when the server went away).
    assert all(s == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
               for s in seen.values()), seen
    assert ended == dict.fromkeys(watches, grpc.StatusCode.OK), ended
    assert "Traceback" not in server.log_text()
    _log_records(server)  # the whole log, shutdown included, is still one JSON object per line
