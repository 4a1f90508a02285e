"""How many minor page faults fresh memory costs on this kernel.

A fault maps one base page (4 KiB) on most kernels, but with multi-size transparent huge pages
(e.g. /sys/kernel/mm/transparent_hugepage/hugepages-16kB/enabled = always, as on Linux 6.x
machines here) one fault maps a whole 16 KiB folio, so 48 MB cost 3,072 faults, not 12,288. Tests
that tell "faulted in afresh" from "reused" compare against this measured figure, not a page count.
"""

from __future__ import annotations

import mmap
import resource


def fresh_faults(nbytes: int) -> int:
    """Minor faults this process takes writing every page of `nbytes` of fresh anonymous memory."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for offset in range(0, nbytes, mmap.PAGESIZE):
            region[offset] = 1
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    finally:
        region.close()
