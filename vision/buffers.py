"""Reused host buffers for the large outputs of preprocessing (the padded image, the float patches).

A fresh buffer of 36 or 145 MB is a fresh memory mapping: the kernel zero-fills each of its pages
on first touch, which costs about a third of building the 12 MP image's float patches (measured:
77.5 ms into a fresh buffer, 49 ms into a touched one). A `BufferPool` hands out buffers that
earlier images already touched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


class BufferPool:
    """Thread-safe free list of 1-D numpy buffers of one dtype. `take(n)` lends the first `n` items
    of a free buffer (the smallest that is large enough; a new one when none is, which is then kept
    for the next image); at most `keep` free buffers are kept, so memory held is bounded by
    `keep` times the largest image seen. Not for data that must outlive the `with` block."""

    def __init__(self, dtype: type, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dtype = np.dtype(dtype)
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextmanager
    def take(self, n: int) -> Iterator[np.ndarray]:
        buffer = self._pop(n)
        try:
            yield buffer[:n]
        finally:
            self._push(buffer)

    def _pop(self, n: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].size))
            if len(self._free) >= self.keep:  # all too small: free the largest before allocating
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].size))
        return np.empty(n, dtype=self.dtype)

    def _push(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.size)
            del self._free[:-self.keep]  # keep the largest ones
