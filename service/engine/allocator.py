"""Keep freed image buffers in the serving process instead of handing them back to the kernel.

A 12 MP decode allocates ~50 MB in 16 MiB blocks (Pillow) plus the padded model input. glibc's
defaults return such memory to the kernel as soon as it is freed (mmap'd chunks are unmapped,
an arena's free top is trimmed past a threshold that adapts to the last large free), so in the
server's thread pool each decode faulted its ~12,000 pages in afresh: 40-50 ms of a ~90 ms
Preprocess. Raising both thresholds keeps up to `trim_bytes` of free memory per malloc arena for
reuse. That is a process-wide choice, so only a process that serves (the `Engine`'s owner) makes
it, never the `vision` library on its caller's behalf.

What is kept is free memory at the arenas' tops; free memory between live chunks (what thousands
of small allocations leave, e.g. gRPC streams that have ended) is never handed back by glibc on its
own, whatever the thresholds: `release_freed_memory` does that, when a burst of such work is over.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2); chunks above it are always
# mmap'd (numpy puts hugepages under those, so their faults are 512x fewer).
MMAP_THRESHOLD_MAX = 32 << 20
# What a serving process (the engine's, each encoder worker) keeps by default.
KEEP_FREED_BYTES = 256 << 20


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt is a no-op, it has no malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def release_freed_memory() -> bool:
    """Hand every arena's free pages back to the kernel now (glibc's `malloc_trim(0)`; a few ms).
    False where the C library is not glibc (then nothing changed)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def keep_freed_memory(trim_bytes: int) -> bool:
    """Serve chunks up to 32 MiB from malloc's arenas and trim an arena only past `trim_bytes` of
    free memory. False where the C library has no glibc `mallopt` (then nothing changed)."""
    if trim_bytes < MMAP_THRESHOLD_MAX:
        raise ValueError(f"trim_bytes must be >= {MMAP_THRESHOLD_MAX} (the mmap threshold), got {trim_bytes}")
    libc = _glibc()
    if libc is None:
        return False
    # Setting either threshold by hand turns off glibc's adaptive thresholds, so set both.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_bytes))
