"""An encoder fleet: three real `serve` processes sharing one store (`--ec-export-dir`). The same
images sent to all three at once are encoded once in total (the towers' own counts say so), and
every answer is the rows a lone encode gives; the instance holding a lease, SIGKILLed mid-encode,
costs the others the lease's life and no error."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.engine import ImageInput
from service.engine.store import FILE_NAME, LEASES, STORE_DTYPE, mm_hash
from service.rpc.client import VisionClient
from tests.images import jpeg, png
from tests.serve_process import ServeProcess

LEASE_S = 3.0


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("fleet-store")


@pytest.fixture(scope="module")
def fleet(store, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    args = ["--devices", "cpu:1", "--components", "vision", "--http-port", "0", "--cache-mb", "0",
            "--ec-export-dir", str(store), "--ec-lease-seconds", str(LEASE_S)]
    started = []
    try:
        for i in range(3):
            started.append(ServeProcess.launch(args, log_path=logs / f"serve-{i}.log"))
        yield [server.wait_ready() for server in started]
    finally:
        for server in started:
            server.kill()


def _scrape(server: ServeProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict[tuple[str, tuple], float], name: str) -> float:
    return sum(value for (n, _), value in samples.items() if n == name)


def _lone_rows(tiny_engine, data: bytes) -> np.ndarray:
    (embedding,) = asyncio.run(tiny_engine.embed([ImageInput(data)]))
    return embedding.rows.to(STORE_DTYPE).float().numpy()


def _model_id(server: ServeProcess) -> str:
    with VisionClient(server.target, timeout=30) as client:
        return client.model_info().model_id


def _embed(server: ServeProcess, data: bytes) -> tuple[object, np.ndarray]:
    with VisionClient(server.target, timeout=120) as client:
        return client.embed(data)


def test_images_sent_to_every_instance_at_once_are_encoded_once_in_all(fleet, store, tiny_engine):
    images = [png(300 + 28 * i, 200, seed=40 + i) for i in range(4)]
    before = [_scrape(s) for s in fleet]
    with ThreadPoolExecutor(len(images) * len(fleet)) as pool:
        answers = list(pool.map(lambda job: _embed(*job), [(s, data) for data in images for s in fleet]))
    after = [_scrape(s) for s in fleet]

    def grew(name: str, **labels) -> float:
        key = tuple(sorted(labels.items()))
        return sum(a.get((name, key), 0.0) - b.get((name, key), 0.0) for a, b in zip(after, before, strict=True))

    runs = sum(_total(a, "kimi_vision_encoder_images_total") - _total(b, "kimi_vision_encoder_images_total")
               for a, b in zip(after, before, strict=True))
    assert runs == len(images), (runs, [s.log_text()[-2000:] for s in fleet])
    assert grew("kimi_vision_ec_store_lookups_total", result="miss") == len(images)
    assert grew("kimi_vision_ec_store_lookups_total", result="hit") == len(images) * (len(fleet) - 1)
    for i, data in enumerate(images):
        lone = _lone_rows(tiny_engine, data)
        mine = answers[i * len(fleet):(i + 1) * len(fleet)]
        for _, rows in mine:
            np.testing.assert_array_equal(rows, lone)
        assert sum(header.cached for header, _ in mine) == len(fleet) - 1
        assert (store / mm_hash(data, _model_id(fleet[0])) / FILE_NAME).is_file()
    # Sent again, to any of them, an image is the store's: no tower runs.
    again = _embed(fleet[1], images[0])
    assert again[0].cached and _total(_scrape(fleet[1]), "kimi_vision_encoder_images_total") == _total(
        after[1], "kimi_vision_encoder_images_total")


def test_a_lease_holder_killed_mid_encode_leaves_the_others_to_finish(fleet, store, tiny_engine):
    data = jpeg(2000, 2000, seed=77)  # about a second of the tiny tower: long enough to be killed in
    key = mm_hash(data, _model_id(fleet[0]))
    lease, entry = store / LEASES / key, store / key / FILE_NAME
    holder, others = fleet[0], fleet[1:]
    waited = sum(_total(_scrape(s), "kimi_vision_ec_store_lease_waits_total") for s in others)
    with ThreadPoolExecutor(3) as pool:
        doomed = pool.submit(_embed, holder, data)
        while not lease.exists():
            assert not doomed.done(), "the holder answered before its lease was seen"
        holder.kill()
        assert not entry.exists(), "the holder finished before it was killed: a larger image is needed"
        waiters = [pool.submit(_embed, server, data) for server in others]
        answers = [w.result(timeout=120) for w in waiters]
        with pytest.raises(Exception):  # noqa: B017 - the holder's caller lost its server, whatever the code
            doomed.result(timeout=30)
    lone = _lone_rows(tiny_engine, data)
    for _, rows in answers:
        np.testing.assert_array_equal(rows, lone)
    assert entry.is_file() and not lease.exists()
    waits = sum(_total(_scrape(s), "kimi_vision_ec_store_lease_waits_total") for s in others) - waited
    assert waits >= len(others)  # each waited: for the dead holder, then the one that took over
