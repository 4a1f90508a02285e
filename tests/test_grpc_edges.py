"""The serving process's side doors, through one real `kimi-vision serve` on 127.0.0.1 with the
health port and `/metrics`: health Watch streams are bounded (per connection and in all) and their
memory comes back when they end; a request that is not protobuf is INVALID_ARGUMENT on every
service of every port; `/metrics` holds no thread per connection, closes idle ones and keeps
answering through a flood of them; kept-alive requests on the metrics and health ports are as fast
as fresh ones.
"""

from __future__ import annotations

import http.client
import os
import socket
import statistics
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from serve_process import ServeProcess

from service.errors import KIND_METADATA
from service.metrics import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from service.rpc._proto import vision_pb2 as pb
from service.rpc.health import MAX_WATCHES, MAX_WATCHES_PER_CONNECTION

pytestmark = pytest.mark.timeout(300)

WATCH = "/grpc.health.v1.Health/Watch"
CHECK = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
VISION = [f"/{pb.DESCRIPTOR.services_by_name['VisionService'].full_name}/{method.name}"
          for method in pb.DESCRIPTOR.services_by_name["VisionService"].methods]
NOT_PROTOBUF = b"\xff\xff\xff\xff\x0f\x08"  # a field tag longer than a varint may be
SETTLE_S = 20.0  # how long RSS may take to come back after the streams end


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("edges") / "serve.log"
    with ServeProcess.start(["--devices", "cpu:1", "--health-port", "0", "--metrics-port", "0"], log_path=log) as proc:
        yield proc


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def _connection(port: int) -> grpc.Channel:
    """A channel on a TCP connection of its own (channels to one target otherwise share one)."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def _watch(channel: grpc.Channel) -> tuple[grpc.Call, str]:
    """Open a Watch and read its first message: ("SERVING", ...) or the refusal's code and details."""
    call = channel.unary_stream(WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)(
        health_pb2.HealthCheckRequest(service=""), timeout=120)
    try:
        return call, health_pb2.HealthCheckResponse.ServingStatus.Name(next(call).status)
    except grpc.RpcError as exc:
        return call, f"{exc.code().name}: {exc.details()}"


def _flood(port: int, connections: int, per_connection: int) -> tuple[Counter, list, list]:
    channels = [_connection(port) for _ in range(connections)]
    calls, outcomes = [], Counter()
    for channel in channels:
        for _ in range(per_connection):
            call, outcome = _watch(channel)
            calls.append(call)
            outcomes[outcome] += 1
    return outcomes, calls, channels


def _end(calls: list, channels: list) -> None:
    for call in calls:
        call.cancel()
    for channel in channels:
        channel.close()


def _settled_rss(pid: int, target: int) -> int:
    deadline = time.monotonic() + SETTLE_S
    while (rss := _rss(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.5)
    return rss


def test_watch_streams_are_bounded_and_their_memory_comes_back(server) -> None:
    pid = server.proc.pid
    # One small round first: what the first Watch streams allocate for good (code paths, pools) is
    # not what a flood leaves behind.
    _end(*_flood(server.health_port, 4, MAX_WATCHES_PER_CONNECTION + 1)[1:])
    time.sleep(2)
    before = _rss(pid)

    connections = MAX_WATCHES // MAX_WATCHES_PER_CONNECTION + 4  # more than the total allows
    outcomes, calls, channels = _flood(server.health_port, connections, MAX_WATCHES_PER_CONNECTION + 2)
    try:
        per_connection = (f"RESOURCE_EXHAUSTED: too many health Watch streams on this connection (at most "
                          f"{MAX_WATCHES_PER_CONNECTION}); end one, or use Check")
        in_all = (f"RESOURCE_EXHAUSTED: too many health Watch streams on this server (at most {MAX_WATCHES}); "
                  "retry later, or use Check")
        full = MAX_WATCHES // MAX_WATCHES_PER_CONNECTION
        assert outcomes == {"SERVING": MAX_WATCHES, per_connection: 2 * full,
                            in_all: (connections - full) * (MAX_WATCHES_PER_CONNECTION + 2)}
        # The bound is the process's: the main port's Watch is refused too, and Check still answers.
        with _connection(server.port) as main:
            call, outcome = _watch(main)
            assert outcome == in_all
            assert (KIND_METADATA, "overloaded") in call.trailing_metadata()
            check = main.unary_unary(CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
            reply = check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        during = _rss(pid)
    finally:
        _end(calls, channels)
    after = _settled_rss(pid, int(before * 1.05))
    print(f"\nserver RSS: {before / 2**20:.1f} MiB before, {during / 2**20:.1f} MiB with {MAX_WATCHES} Watch streams "
          f"open ({sum(outcomes.values())} asked), {after / 2**20:.1f} MiB after they ended")
    assert after <= before * 1.05
    # Streams ended free their places: a new connection may watch again.
    with _connection(server.health_port) as again:
        call, outcome = _watch(again)
        assert outcome == "SERVING"
        call.cancel()


@pytest.mark.parametrize("port_name", ["port", "health_port"])
def test_bytes_that_are_not_protobuf_are_invalid_argument_on_every_method(server, port_name: str) -> None:
    port = getattr(server, port_name)
    served = [CHECK, WATCH] + ([*VISION, REFLECTION] if port_name == "port" else [])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in [*VISION, CHECK, WATCH, REFLECTION]:
            # The request shape on the wire is the same for every kind of RPC; a stream of one
            # message reaches a request-streaming method (reflection) as that method expects.
            call = channel.stream_stream(method)
            with pytest.raises(grpc.RpcError) as info:
                list(call(iter([NOT_PROTOBUF]), timeout=30))
            if method not in served:  # the health port serves health alone
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
                continue
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
            assert info.value.details() == (f"the request to {method} is not a valid protobuf message of its type "
                                            f"({len(NOT_PROTOBUF)} bytes)")
            assert (KIND_METADATA, "bad_input") in info.value.trailing_metadata()


# ---------------------------------------------------------------------------------------------
# /metrics


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _scrape(port: int) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    return connection.getresponse()


def test_idle_metrics_connections_hold_no_threads_are_bounded_and_closed(server) -> None:
    pid, port = server.proc.pid, server.metrics_port
    threads = _threads(pid)
    kept_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    kept_alive.request("GET", "/metrics")
    assert kept_alive.getresponse().read()  # then idle, kept alive
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]  # send nothing
    try:
        response = _scrape(port)
        assert response.status == 200 and b"grpc_server_started_total" in response.read()
        assert _threads(pid) <= threads + 2, "a thread per connection"
        time.sleep(0.5)
        still_open = [sock for sock in idle if not _closed_by_server(sock)]
        assert len(still_open) <= MAX_CONNECTIONS
        time.sleep(IDLE_TIMEOUT_S + 1)
        assert all(_closed_by_server(sock) for sock in still_open)
        assert _closed_by_server(kept_alive.sock)
        assert _scrape(port).status == 200
    finally:
        for sock in idle:
            sock.close()
        kept_alive.close()


def test_metrics_port_answers_metrics_only_and_refuses_bad_http(server) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    for method, path, status in (("HEAD", "/metrics", 200), ("GET", "/metrics?name[]=grpc_server_started_total", 200),
                                 ("GET", "/", 404), ("HEAD", "/", 404), ("POST", "/metrics", 405),
                                 ("GET", "/metrics", 200)):
        connection.request(method, path)
        response = connection.getresponse()
        body = response.read()
        assert response.status == status, (method, path)
        if method == "GET" and status == 200 and "name[]" in path:
            assert b"grpc_server_started_total" in body and b"process_resident_memory_bytes" not in body
    connection.close()
    with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n")
        answer = sock.recv(1 << 16)
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert sock.recv(1 << 16) == b""  # and closed


def _median_ms(run, times: int = 20) -> float:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def test_kept_alive_metrics_scrapes_are_as_fast_as_fresh_ones(server) -> None:
    port = server.metrics_port
    kept_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def again() -> None:
        kept_alive.request("GET", "/metrics")
        assert kept_alive.getresponse().read()

    again()
    reused = _median_ms(again)
    fresh = _median_ms(lambda: _scrape(port).read())
    kept_alive.close()
    print(f"\n/metrics median of 20: kept alive {reused:.2f} ms, fresh connection {fresh:.2f} ms")
    assert reused <= fresh + 2


def test_kept_alive_health_checks_are_as_fast_as_fresh_ones(server) -> None:
    request = health_pb2.HealthCheckRequest(service="")

    def check(channel: grpc.Channel) -> None:
        call = channel.unary_unary(CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                   response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert call(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING

    def fresh_check() -> None:
        with _connection(server.health_port) as channel:
            check(channel)

    with _connection(server.health_port) as kept_alive:
        check(kept_alive)
        reused = _median_ms(lambda: check(kept_alive))
    fresh = _median_ms(fresh_check)
    print(f"\nhealth Check median of 20: kept alive {reused:.2f} ms, fresh connection {fresh:.2f} ms")
    assert reused <= fresh + 2
