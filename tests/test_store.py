"""The encoder-cache store (`service.engine.store`) on a real directory, as several instances
share it: each a `Store` of its own (its own owner), as separate processes' would be."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch

from service.engine.store import (
    FILE_NAME,
    LEASES,
    STORE_DTYPE,
    ItemKey,
    Lease,
    Store,
    StoreConfig,
    ec_path,
    write_ec,
)
from service.metrics import Metrics

HIDDEN = 8


def _store(directory: Path, metrics: Metrics | None = None, **kw) -> Store:
    config = StoreConfig(directory, "moonshotai/Kimi-K3", "blake3", "ckpt-a", **kw)
    return Store(config, metrics or Metrics())


def _key(i: int) -> ItemKey:
    return ItemKey(f"{i:064x}", f"{i:064x}")


def _rows(i: int, tokens: int = 64) -> torch.Tensor:
    return torch.full((tokens, HIDDEN), float(i), dtype=STORE_DTYPE)


def _run(fn, *args) -> asyncio.Future:
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_hit_is_only_this_image_encoded_by_this_checkpoint_in_the_store_dtype(tmp_path):
    store = _store(tmp_path)
    key = _key(1)
    store.put(key, _rows(1), "image")
    assert torch.equal(store.lookup(key, (64, HIDDEN)), _rows(1))
    assert store.lookup(ItemKey(key.key, _key(2).image), (64, HIDDEN)) is None  # another image under that name
    assert store.lookup(key, (63, HIDDEN)) is None  # not the rows this item's plan makes
    assert _store(tmp_path).lookup(key, (64, HIDDEN)) is not None  # another instance of one checkpoint
    other = Store(StoreConfig(tmp_path, "moonshotai/Kimi-K3", "blake3", "ckpt-b"), Metrics())
    assert other.lookup(key, (64, HIDDEN)) is None  # another checkpoint's
    write_ec(tmp_path, _key(3).key, _rows(3).float(), _key(3).image, checkpoint="ckpt-a")
    assert store.lookup(_key(3), (64, HIDDEN)) is None  # float32 rows: not what the store serves


def test_one_lease_at_a_time_and_a_dead_owners_is_taken_over(tmp_path):
    first, second = _store(tmp_path, lease_s=30.0), _store(tmp_path, lease_s=30.0)
    lease = first.take("k")
    assert isinstance(lease, Lease)
    left = second.take("k")
    assert isinstance(left, float) and 29.0 < left <= 30.0
    record = json.loads((tmp_path / LEASES / "k").read_text())
    assert record["owner"] == lease.owner and record["expires"] > time.time()
    # Its owner died: the lease's expiry passes and the next instance takes it over.
    (tmp_path / LEASES / "k").write_text(json.dumps({"owner": lease.owner, "expires": time.time() - 1}))
    taken = second.take("k")
    assert isinstance(taken, Lease) and taken.owner != lease.owner
    first._release(lease)  # the old owner, late: not its lease to remove any more
    assert json.loads((tmp_path / LEASES / "k").read_text())["owner"] == taken.owner
    second._release(taken)
    assert not (tmp_path / LEASES / "k").exists()
    assert [p.name for p in (tmp_path / LEASES).iterdir()] == []  # no temporary file left behind


def test_instances_wait_for_the_lease_holders_entry_and_the_tower_runs_once(tmp_path):
    metrics = [Metrics() for _ in range(3)]
    stores = [_store(tmp_path, m, lease_s=30.0) for m in metrics]
    runs = []

    async def encode() -> torch.Tensor:
        runs.append(1)
        await asyncio.sleep(0.3)
        return _rows(7).float()

    async def main():
        return await asyncio.gather(*(s.through(_key(7), (64, HIDDEN), encode, _run, "image") for s in stores))

    results = asyncio.run(main())
    assert len(runs) == 1
    assert sorted(stored for _, stored in results) == [False, True, True]
    assert all(torch.equal(rows, _rows(7)) and rows.dtype == STORE_DTYPE for rows, _ in results)
    assert sum(_value(m, "kimi_vision_ec_store_lease_waits_total") for m in metrics) == 2
    assert sum(_value(m, "kimi_vision_ec_store_lookups_total", result="hit") for m in metrics) == 2
    assert not (tmp_path / LEASES / _key(7).key).exists()


def test_a_failed_or_cancelled_encode_gives_its_lease_back(tmp_path):
    store = _store(tmp_path)

    async def fails() -> torch.Tensor:
        raise ValueError("bad image")

    async def hangs() -> torch.Tensor:
        await asyncio.sleep(60)
        raise AssertionError("not reached")

    async def main():
        with pytest.raises(ValueError):
            await store.through(_key(1), (64, HIDDEN), fails, _run, "image")
        task = asyncio.ensure_future(store.through(_key(2), (64, HIDDEN), hangs, _run, "image"))
        while not (tmp_path / LEASES / _key(2).key).exists():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the release runs on a thread

    asyncio.run(main())
    assert list((tmp_path / LEASES).iterdir()) == []
    assert not ec_path(tmp_path, _key(1).key).exists()


def _entries(directory: Path) -> dict[str, int]:
    return {p.name: (p / FILE_NAME).stat().st_size for p in directory.iterdir() if p.name[0] != "."}


def test_a_budget_keeps_the_newest_entries_within_it_plus_one(tmp_path):
    metrics = Metrics()
    entry = len((write_ec(tmp_path / "probe", "x", _rows(0), "x", checkpoint="ckpt-a")).read_bytes())
    budget = 5 * entry + entry // 2
    store = _store(tmp_path / "store", metrics, max_bytes=budget, min_age_s=0.0)
    for i in range(12):
        store.put(_key(i), _rows(i), "image")
        os.utime(ec_path(tmp_path / "store", _key(i).key), (1000.0 + i, 1000.0 + i))  # written in order
        assert sum(_entries(tmp_path / "store").values()) <= budget + entry
    # The last scan evicted down to the budget: what is left is the newest, in full.
    kept = sorted(_entries(tmp_path / "store"))
    assert kept == sorted(_key(i).key for i in range(12 - len(kept), 12)) and len(kept) >= 5
    assert _value(metrics, "kimi_vision_ec_store_evictions_total") == 12 - len(kept)
    assert _value(metrics, "kimi_vision_ec_store_bytes") <= budget
    # A hit renews an entry's use: the oldest, once looked up, outlives younger ones.
    oldest = _key(12 - len(kept))
    assert store.lookup(oldest, (64, HIDDEN)) is not None
    store.put(_key(99), _rows(99), "image")
    store.evict()
    assert oldest.key in _entries(tmp_path / "store")


def test_an_entry_younger_than_the_minimum_age_is_never_evicted(tmp_path):
    entry_bytes = 0
    store = _store(tmp_path, max_bytes=1, min_age_s=300.0)
    for i in range(4):
        store.put(_key(i), _rows(i), "image")
        entry_bytes = ec_path(tmp_path, _key(i).key).stat().st_size
    assert len(_entries(tmp_path)) == 4  # all over the budget, all too young to go
    old = ec_path(tmp_path, _key(0).key)
    os.utime(old, (time.time() - 301, time.time() - 301))
    store.evict()
    assert sorted(_entries(tmp_path)) == sorted(_key(i).key for i in (1, 2, 3)) and entry_bytes > 0


def test_instances_evicting_one_directory_at_once_each_entry_goes_once(tmp_path):
    counts = [Metrics() for _ in range(3)]
    seed = _store(tmp_path)
    for i in range(30):
        seed.put(_key(i), _rows(i), "image")
        os.utime(ec_path(tmp_path, _key(i).key), (1000.0 + i, 1000.0 + i))
    size = ec_path(tmp_path, _key(0).key).stat().st_size
    stores = [_store(tmp_path, m, max_bytes=10 * size, min_age_s=0.0) for m in counts]

    async def main():
        await asyncio.gather(*(_run(s.evict) for s in stores))

    asyncio.run(main())
    assert sorted(_entries(tmp_path)) == sorted(_key(i).key for i in range(20, 30))
    assert sum(_value(m, "kimi_vision_ec_store_evictions_total") for m in counts) == 20
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".evicted")] == []


def test_what_a_killed_writer_left_is_swept_by_a_scan(tmp_path):
    store = _store(tmp_path, max_bytes=10**9, lease_s=30.0, min_age_s=300.0)
    half = tmp_path / _key(1).key
    half.mkdir()
    (half / f".{FILE_NAME}.123-abc.tmp").write_bytes(b"half a file")
    assert isinstance(store.take(_key(2).key), Lease)  # its owner then died
    young = tmp_path / _key(3).key
    young.mkdir()  # a live writer's, just begun
    old = time.time() - 331
    for path in (half, tmp_path / LEASES / _key(2).key):
        os.utime(path, (old, old))
    store.evict()
    assert not half.exists() and not (tmp_path / LEASES / _key(2).key).exists()
    assert young.exists()
