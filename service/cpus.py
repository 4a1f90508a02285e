"""How many CPUs this process may use, which every thread default is sized from (the encoder
workers' torch and OpenCV threads, the engine's request threads, the serving process's torch threads
(a CPU trunk's: what the CPU workers leave)),
and how much memory (`usable_memory`: the CPU trunk's default KV budget is a share of it).

`os.cpu_count()` counts the machine's cores: in a container limited to 2 CPUs on a 64-core node it
says 64, and 64-thread pools on 2 CPUs' worth of time only get throttled. What binds is the
smaller of the affinity mask (`taskset`, a cpuset, Kubernetes' static CPU manager) and the CPU
quota of the process's cgroup (`docker run --cpus`, a pod's CPU limit): cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` over `cpu.cfs_period_us`. A quota set on any cgroup from the process's own up
to the root of the hierarchy binds it, so the smallest along that path counts. A fractional quota
rounds down (at least 1): a thread beyond the quota is one that waits for the next period.

Memory likewise: the machine's physical memory, or less where a cgroup on the same path limits it
(v2 `memory.max`, v1 `memory.limit_in_bytes`; `docker run --memory`, a pod's memory limit), the
smallest along the path: past it the kernel's OOM killer ends the process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

CGROUP_ROOT = Path("/sys/fs/cgroup")
OWN_CGROUPS = Path("/proc/self/cgroup")

T = TypeVar("T", int, float)

__all__ = ["CGROUP_ROOT", "OWN_CGROUPS", "CpuBudget", "cpu_budget", "memory_limit", "usable_memory"]


@dataclass(frozen=True)
class CpuBudget:
    affinity: int  # CPUs in the process's affinity mask
    quota: float | None  # CPUs' worth of time the cgroup quota allows; None: no quota

    @property
    def usable(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota)))

    def per_worker(self, workers: int) -> int:
        """Threads for each of `workers` processes sharing the usable CPUs (at least 1): more only spin
        against each other (OpenMP's idle threads busy-wait)."""
        return max(1, self.usable // workers)

    def trunk_threads(self, worker_threads: int) -> int:
        """Torch threads for a CPU trunk beside encoder workers that hold `worker_threads` threads
        on the same CPUs: the CPUs they leave, at least 1. A decode step is a chain of small ops:
        threads past the CPUs wait at every parallel op for one the workers have preempted (on 2
        CPUs, 2 trunk threads beside a 2-thread worker served a third of the requests 1 thread did)."""
        return max(1, self.usable - worker_threads)

    def __str__(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return f"{self.usable} usable (affinity {self.affinity} CPUs, cgroup quota {quota})"


def cpu_budget(cgroup_root: Path = CGROUP_ROOT, own_cgroups: Path = OWN_CGROUPS) -> CpuBudget:
    """The CPUs this process may use. `cgroup_root`: where the cgroup hierarchy is mounted (a v2
    mount has `cgroup.controllers`; otherwise v1, with the cpu controller at `cpu/`); `own_cgroups`:
    the process's cgroups, as /proc/self/cgroup lists them."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none
    return CpuBudget(affinity, _cgroup_quota(Path(cgroup_root), Path(own_cgroups)))


def memory_limit(cgroup_root: Path = CGROUP_ROOT, own_cgroups: Path = OWN_CGROUPS) -> int | None:
    """The smallest memory limit (bytes) on the process's cgroup and its ancestors; None: none (or
    no cgroup mount). `cgroup_root`, `own_cgroups`: as for `cpu_budget`, with the v1 memory
    controller at `memory/` (v1 says "no limit" with a number beyond any machine's memory)."""
    return _smallest(Path(cgroup_root), Path(own_cgroups), "memory", _memory_v2, _memory_v1)


def usable_memory(cgroup_root: Path = CGROUP_ROOT, own_cgroups: Path = OWN_CGROUPS) -> int:
    """Bytes of memory this process may use: the machine's physical memory, or its cgroup's limit
    when that is lower."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = memory_limit(cgroup_root, own_cgroups)
    return physical if limit is None else min(physical, limit)


def _cgroup_quota(root: Path, own_cgroups: Path) -> float | None:
    return _smallest(root, own_cgroups, "cpu", _quota_v2, _quota_v1)


def _smallest(root: Path, own_cgroups: Path, controller: str, read_v2: Callable[[Path], T | None],
              read_v1: Callable[[Path], T | None]) -> T | None:
    """The smallest value `read_v2` (a v2 mount) or `read_v1` (`controller`'s v1 hierarchy) finds on
    the process's cgroup and its ancestors; None where none has one."""
    v2 = (root / "cgroup.controllers").exists()
    base = root if v2 else root / controller
    own = _own_cgroup(own_cgroups, v2, controller) if base.is_dir() else None
    if own is None:
        return None
    # The process's cgroup and every ancestor, nearest first. Inside a container the hierarchy is often
    # mounted from the container's own cgroup while /proc still names the host's path to it: the
    # directories that do not exist below the mount are skipped, the mount itself is the container's.
    directory = base / own.strip("/")
    chain = [directory, *(p for p in directory.parents if p.is_relative_to(base))]
    read = read_v2 if v2 else read_v1
    values = [value for d in chain if d.is_dir() and (value := read(d)) is not None]
    return min(values, default=None)


def _own_cgroup(own_cgroups: Path, v2: bool, controller: str) -> str | None:
    """The process's cgroup path in the v2 hierarchy, or in the v1 hierarchy holding `controller`."""
    for line in own_cgroups.read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if (number == "0" and controllers == "") if v2 else controller in controllers.split(","):
            return path
    return None


def _quota_v2(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except FileNotFoundError:  # the root cgroup has none
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except FileNotFoundError:
        return None
    return None if quota < 0 else quota / period


def _memory_v2(directory: Path) -> int | None:
    try:
        limit = (directory / "memory.max").read_text().strip()
    except FileNotFoundError:  # the root cgroup has none
        return None
    return None if limit == "max" else int(limit)


def _memory_v1(directory: Path) -> int | None:
    try:
        return int((directory / "memory.limit_in_bytes").read_text())
    except FileNotFoundError:
        return None
