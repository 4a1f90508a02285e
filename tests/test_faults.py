"""Faults with real processes: an encoder worker killed mid-request, clients that give up while
queued, overload (bench/load.py in short form: only RESOURCE_EXHAUSTED sheds load), and SIGTERM
to a serving `kimi-vision serve` (the same process, after the overload run).

To hold a request "mid-request" deterministically the tests freeze the encoder worker with
SIGSTOP: the request is then in the worker's hands (the pool counts it in flight) for as long as
the test needs, where timing a real encode would race with the kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import psutil
import pytest
from images import png
from serve_process import REPO_ROOT, ServeProcess, free_port

from service.engine import EngineConfig
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import VisionClient, image, user
from service.server import ServerConfig, ServerThread

# A killed worker is back within 10 s. Wall time is judged only when the machine is not
# oversubscribed (load average <= cores): on a shared 2-core box at load 9, importing torch alone
# takes 10 s of wall time. The restart's own CPU cost is judged always.
RESTART_LIMIT_S = 10.0




def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def rpc_code(future: Future, timeout_s: float = 60.0) -> str:
    try:
        future.result(timeout_s)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


@pytest.fixture(scope="module")
def handle(tiny_checkpoint):
    # One work slot and one queue place: capacity 2, so queueing is easy to observe.
    config = ServerConfig(port=0, max_concurrency=1, max_queue=1)
    with ServerThread(config, EngineConfig(checkpoint=tiny_checkpoint, devices="cpu:1", cache_bytes=0)) as h:
        yield h


@pytest.fixture(scope="module")
def client(handle: ServerThread):
    with VisionClient(handle.target, timeout=120) as c:
        yield c


@pytest.fixture
def pool_ex():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def _worker(handle: ServerThread) -> dict:
    return handle.engine.pool.health()["workers"][0]


def test_kill_9_worker_mid_request(handle: ServerThread, client: VisionClient, pool_ex: ThreadPoolExecutor) -> None:
    before = _worker(handle)
    assert before["ready"]
    pid = before["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        request = pool_ex.submit(client.embed, png(96, 64, seed=1))
        wait_for(lambda: _worker(handle)["inflight"] == 1, 60, "the image to reach the worker")
    finally:
        os.kill(pid, signal.SIGKILL)  # also ends the stop
    killed_at = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        request.result(60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert re.search(r"worker died.*retry", info.value.details())

    wait_for(lambda: _worker(handle)["pid"] not in (None, pid), 5, "the pool to start a new worker")
    new_pid = _worker(handle)["pid"]
    wait_for(lambda: _worker(handle)["ready"], 60, "the new worker to be ready")
    took = time.monotonic() - killed_at
    cpu = psutil.Process(new_pid).cpu_times()
    work = cpu.user + cpu.system  # what the restart costs, whatever else the machine is doing
    print(f"encoder worker back {took:.1f} s after kill -9 ({work:.1f} s of CPU; load {os.getloadavg()[0]:.1f})")
    assert work < RESTART_LIMIT_S, f"a worker restart costs {work:.1f} CPU seconds"
    if os.getloadavg()[0] <= (os.cpu_count() or 1):
        assert took < RESTART_LIMIT_S, f"worker restart took {took:.1f} s on an uncontended machine"
    assert _worker(handle)["restarts"] == before["restarts"] + 1
    # Later requests are served, including the very image that failed (a retry).
    for seed in (1, 2):
        header, rows = client.embed(png(96, 64, seed=seed))
        assert rows.shape == (header.num_tokens, header.hidden_size) and np.isfinite(rows).all()
    # Health follows the pool (NOT_SERVING while no worker is ready), checked about once a second.
    wait_for(lambda: client.health() == "SERVING", 5, "health SERVING again")


def test_client_cancellation_frees_the_queue_slot(handle: ServerThread, client: VisionClient,
                                                  pool_ex: ThreadPoolExecutor) -> None:
    admission = handle.server.admission
    pid = _worker(handle)["pid"]
    os.kill(pid, signal.SIGSTOP)  # the slot holder's image waits in the frozen worker
    try:
        # Streaming calls are call objects the client can cancel.
        a = client.stub.Embed(pb.EmbedRequest(image=image(png(96, 64, seed=10))))
        a_done = pool_ex.submit(list, a)
        wait_for(lambda: admission.working == 1, 30, "request A to hold the slot")
        b = client.stub.Embed(pb.EmbedRequest(image=image(png(96, 64, seed=11))))
        b_done = pool_ex.submit(list, b)
        wait_for(lambda: admission.admitted == 2, 30, "request B to queue")
        # Full (1 working + 1 queued): a third request is refused at once.
        with pytest.raises(grpc.RpcError) as info:
            client.count_tokens(png(96, 64, seed=12))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        b.cancel()
        assert rpc_code(b_done) == "CANCELLED"
        wait_for(lambda: admission.admitted == 1, 10, "B's queue place to be freed")
        # The freed place takes a new request (queued behind A, not refused).
        d_done = pool_ex.submit(client.count_tokens, png(96, 64, seed=13))
        wait_for(lambda: admission.admitted == 2, 10, "request D to queue")
        a.cancel()
        assert rpc_code(a_done) == "CANCELLED"
        assert d_done.result(30).num_tokens > 0  # A's slot went to D
        wait_for(lambda: admission.admitted == 0, 10, "all slots to be free")
    finally:
        os.kill(pid, signal.SIGCONT)
    header, rows = client.embed(png(96, 64, seed=14))
    assert rows.shape[0] == header.num_tokens
    assert client.health() == "SERVING"


# ---------------------------------------------------------------------------------------------
# SIGTERM to a real `kimi-vision serve`




def _gauge(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A `kimi-vision serve` subprocess with a small admission capacity (1 working + 2 queued)."""
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("faults") / "serve.log"
    args = ["--devices", "cpu:1", "--metrics-port", str(metrics_port), "--drain-seconds", "60",
            "--max-concurrency", "1", "--max-queue", "2", "--cache-mb", "16"]
    with ServeProcess.start(args, log_path=log) as server:
        server.metrics_port = metrics_port
        yield server


def test_overload_sheds_only_with_resource_exhausted(served: ServeProcess, tmp_path) -> None:
    """bench/load.py in short form: 12 clients against 3 places; only OK or RESOURCE_EXHAUSTED."""
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "bench.load", "--target", served.target, "--server-pid",
                          str(served.proc.pid), "--clients", "12", "--seconds", "5", "--warmup-seconds", "0",
                          "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert set(report["codes"]) == {"OK", "RESOURCE_EXHAUSTED"}, report["codes"]
    assert report["health_at_end"] == "SERVING"
    assert report["rss_mib"]["samples"] >= 5 and report["rss_mib"]["max"] < 1536
    assert served.proc.poll() is None


def test_sigterm_drains_and_exits_0(served: ServeProcess, pool_ex: ThreadPoolExecutor) -> None:
    client = VisionClient(served.target, timeout=120)
    assert client.health() == "SERVING"
    (worker,) = served.encoder_workers()
    worker.suspend()  # SIGSTOP: the in-flight request stays in flight until we say so
    try:
        inflight = pool_ex.submit(client.embed, png(96, 64, seed=20))
        wait_for(lambda: _gauge(served.metrics_port, "kimi_vision_inflight_requests") == 1, 60, "a request in flight")
        served.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: client.health() == "NOT_SERVING", 10, "health NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.RpcError) as info:
            client.preprocess(png(96, 64, seed=21))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not inflight.done()
    finally:
        worker.resume()
    header, rows = inflight.result(60)  # the in-flight request finishes normally
    assert rows.shape == (header.num_tokens, header.hidden_size)
    client.close()
    assert served.proc.wait(60) == 0
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, "encoder worker left behind"
    log = served.log_text()
    assert "Traceback" not in log, log[-3000:]


def test_cancelled_stream_stops_on_the_server(handle: ServerThread, client: VisionClient) -> None:
    """A Generate stream the client drops is cancelled on the server and gives its slot back."""
    cancelled = handle.server.metrics.grpc_handled.labels("server_stream", "kimi.vision.v1.VisionService", "Generate",
                                                          "Canceled")
    before = cancelled._value.get()
    stream = client.generate([user("Tell me a long story.")], max_new_tokens=4000)
    next(stream)
    stream.cancel()
    wait_for(lambda: handle.server.admission.admitted == 0, 20, "the cancelled Generate to release its slot")
    wait_for(lambda: cancelled._value.get() == before + 1, 20, "the server to record the cancellation")
