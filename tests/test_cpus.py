"""service.cpus: the CPUs and the memory the process may use, read from fake cgroup trees laid out
as the kernel lays them out (v2 `cpu.max`, `memory.max`; v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`, `memory.limit_in_bytes`), and the defaults that follow them (threads, the CPU
trunk's KV budget)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from service.cli import serve
from service.cpus import CpuBudget, cpu_budget, memory_limit, usable_memory
from service.engine.scheduler import KV_MEMORY_FRACTION, default_kv_cache_bytes

AFFINITY = len(os.sched_getaffinity(0))
PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _own(tmp_path: Path, *lines: str) -> Path:
    """A /proc/self/cgroup."""
    return _tree(tmp_path, {"proc-self-cgroup": "\n".join(lines) + "\n"}) / "proc-self-cgroup"


def test_the_default_thread_counts_follow_a_v2_quota(tmp_path):
    root = _tree(tmp_path / "cgroup", {"cgroup.controllers": "cpuset cpu memory\n", "cpu.max": "100000 100000\n"})
    budget = cpu_budget(root, _own(tmp_path, "0::/"))
    assert budget.quota == 1.0 and budget.usable == 1
    assert budget.per_worker(1) == 1 and budget.per_worker(2) == 1  # what the encoder pool gives each worker
    assert str(budget) == f"1 usable (affinity {AFFINITY} CPUs, cgroup quota 1 CPUs)"


def test_the_smallest_quota_on_the_way_up_binds(tmp_path):
    """A pod's limit sits on the pod's cgroup, the container runs in a child of it (no quota of its own)."""
    root = _tree(tmp_path / "cgroup", {
        "cgroup.controllers": "cpu\n",
        "kubepods.slice/cpu.max": "max 100000\n",
        "kubepods.slice/pod1/cpu.max": "250000 100000\n",
        "kubepods.slice/pod1/ctr/cpu.max": "max 100000\n",
    })
    budget = cpu_budget(root, _own(tmp_path, "0::/kubepods.slice/pod1/ctr"))
    assert budget.quota == 2.5
    assert budget.usable == min(AFFINITY, 2)  # a fractional CPU rounds down: that thread would only be throttled
    assert cpu_budget(root, _own(tmp_path, "0::/kubepods.slice")).quota is None  # "max": no quota


def test_v1_quota_with_the_containers_cgroup_mounted_as_the_root(tmp_path):
    """cgroup v1 in a container: /proc names the host's path (/docker/ID), the mount holds the
    container's own cgroup at its top."""
    root = _tree(tmp_path / "cgroup", {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n",
                                       "memory/memory.limit_in_bytes": "1073741824\n"})
    own = _own(tmp_path, "12:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "3:cpuset:/docker/abc",
               "0::/docker/abc")
    budget = cpu_budget(root, own)
    assert budget.quota == 0.5 and budget.usable == 1  # never fewer than one thread
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_budget(root, own) == CpuBudget(AFFINITY, None)


def test_without_a_quota_or_a_cgroup_mount_the_affinity_counts(tmp_path):
    assert cpu_budget(tmp_path / "no-such-mount", _own(tmp_path, "0::/")) == CpuBudget(AFFINITY, None)
    root = _tree(tmp_path / "cgroup", {"cgroup.controllers": "memory\n"})  # the root cgroup has no cpu.max
    assert cpu_budget(root, _own(tmp_path, "0::/")).usable == AFFINITY


@pytest.mark.parametrize(("affinity", "quota", "usable", "per_two"), [
    (64, 2.0, 2, 1), (64, None, 64, 32), (4, 16.0, 4, 2), (64, 0.2, 1, 1), (3, None, 3, 1),
])
def test_usable_is_the_affinity_capped_by_the_quota(affinity, quota, usable, per_two):
    budget = CpuBudget(affinity, quota)
    assert budget.usable == usable and budget.per_worker(2) == per_two


def test_the_smallest_memory_limit_on_the_way_up_binds(tmp_path):
    root = _tree(tmp_path / "cgroup", {
        "cgroup.controllers": "cpu memory\n",
        "kubepods.slice/memory.max": "max\n",
        "kubepods.slice/pod1/memory.max": "2147483648\n",
        "kubepods.slice/pod1/ctr/memory.max": "4294967296\n",
    })
    own = _own(tmp_path, "0::/kubepods.slice/pod1/ctr")
    assert memory_limit(root, own) == 2 << 30
    assert usable_memory(root, own) == min(PHYSICAL, 2 << 30)
    assert memory_limit(root, _own(tmp_path, "0::/kubepods.slice")) is None  # "max": no limit


def test_v1_memory_limit_with_the_containers_cgroup_mounted_as_the_root(tmp_path):
    root = _tree(tmp_path / "cgroup", {"memory/memory.limit_in_bytes": "1073741824\n",
                                       "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    own = _own(tmp_path, "12:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/docker/abc")
    assert memory_limit(root, own) == 1 << 30 and usable_memory(root, own) == min(PHYSICAL, 1 << 30)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert usable_memory(root, own) == PHYSICAL


def test_without_a_memory_limit_or_a_cgroup_mount_the_physical_memory_counts(tmp_path):
    assert memory_limit(tmp_path / "no-such-mount", _own(tmp_path, "0::/")) is None
    root = _tree(tmp_path / "cgroup", {"cgroup.controllers": "memory\n"})  # the root cgroup has no memory.max
    assert usable_memory(root, _own(tmp_path, "0::/")) == PHYSICAL


@pytest.mark.parametrize(("usable", "worker_threads", "trunk"),
                         [(2, 2, 1), (2, 0, 2), (8, 2, 6), (16, 16, 1), (1, 4, 1)])
def test_a_cpu_trunk_takes_the_cpus_the_encoder_workers_leave(usable, worker_threads, trunk):
    assert CpuBudget(usable, None).trunk_threads(worker_threads) == trunk


def test_the_cpu_trunks_default_kv_budget_is_a_share_of_the_usable_memory():
    """Not of the machine's: in a container with a memory limit that would be OOM-killed."""
    assert default_kv_cache_bytes(torch.device("cpu")) == int(usable_memory() * KV_MEMORY_FRACTION)


def test_this_machine_reads_without_error():
    budget = cpu_budget()
    assert 1 <= budget.usable <= AFFINITY


def test_serve_takes_an_explicit_thread_count_and_refuses_a_bad_one(capsys):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve._problem(parser.parse_args(["--threads-per-worker", "3"])) is None
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--threads-per-worker", "0"])
    assert exited.value.code == 2
    assert "argument --threads-per-worker: must be >= 1, got 0" in capsys.readouterr().err
