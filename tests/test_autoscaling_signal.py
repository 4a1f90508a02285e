"""The encoder fleet's autoscaling signal as Prometheus reads it: `kimi_vision_encoder_busy_seconds_total`
scraped from a real `kimi-vision serve --components vision` (two CPU encoder workers), idle and under
a load that keeps both workers holding images. What the HPA gets is prometheus-adapter's rule
(deploy/prometheus/adapter-rules.yaml): each worker's increase over a window, over the window's
length, averaged over the pod's workers; `busy_ratio` here is that, over two scrapes."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from images import png
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess

from service.rpc.client import VisionClient

BUSY = "kimi_vision_encoder_busy_seconds_total"
WORKERS = 2
CLIENTS = 8  # two images in each worker's hands and two waiting behind them: a worker never idles
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("autoscale") / "serve.log"
    args = ["--components", "vision", "--devices", f"cpu:{WORKERS}", "--metrics-port", "0", "--cache-mb", "0",
            "--max-concurrency", str(CLIENTS)]
    with ServeProcess.start(args, log_path=log) as proc:
        yield proc


def _busy(server: ServeProcess) -> tuple[float, dict[str, float]]:
    """The scrape's time and each worker's busy seconds, by Prometheus' own parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    at = time.monotonic()
    samples = {s.labels["worker"]: s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == BUSY}
    assert len(samples) == WORKERS, samples
    return at, samples


def busy_ratio(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]]) -> float:
    """sum by pod (rate(busy seconds)) / count by pod (busy seconds), between two scrapes."""
    (t0, a), (t1, b) = before, after
    assert all(b[w] >= a[w] for w in a), (a, b)  # a counter
    return sum(b[w] - a[w] for w in a) / (t1 - t0) / len(a)


def test_busy_ratio_is_0_idle_and_near_1_under_a_saturating_load(server: ServeProcess) -> None:
    # Idle (warmed up, nothing sent): the counters stand still.
    idle = _busy(server)
    time.sleep(2.0)
    assert busy_ratio(idle, _busy(server)) == 0.0

    seeds = itertools.count(1)  # every image new: no cache, no single flight, each one a tower run
    stop = threading.Event()
    answered = [0] * CLIENTS

    def send(n: int) -> None:
        with VisionClient(server.target, timeout=120) as client:
            while not stop.is_set():
                _, rows = client.embed(png(448, 448, seed=next(seeds)))
                assert rows.shape[0] > 0
                answered[n] += 1

    with ThreadPoolExecutor(CLIENTS) as ex:
        clients = [ex.submit(send, n) for n in range(CLIENTS)]
        while sum(answered) < 2 * CLIENTS:  # every client past its first image: the load is steady
            assert not any(c.done() for c in clients), [c.exception() for c in clients if c.done()]
            time.sleep(0.05)
        start = _busy(server)
        time.sleep(6.0)
        loaded = busy_ratio(start, _busy(server))
        stop.set()
        for c in clients:
            c.result(timeout=120)
    print(f"\nbusy ratio: idle 0, under {CLIENTS} clients {loaded:.3f} ({sum(answered)} images)")
    # 1 at most (no worker is busy longer than the wall clock), give or take how long each scrape took
    assert 0.9 <= loaded <= 1.02, loaded

    # Every answer in: idle again, and the counters keep what they counted.
    after = _busy(server)
    time.sleep(1.0)
    assert busy_ratio(after, _busy(server)) == 0.0
