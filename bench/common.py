"""What several benchmarks share: photo-like test images and a best-of-N timer."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Photo-like uint8 RGB content: smooth gradients, edges and mild sensor noise (so its JPEG
    sizes are realistic, unlike noise or flat colour)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    r = 120 + 90 * np.sin(6 * x + 2 * y)
    g = 110 + 80 * np.cos(5 * y - 3 * x)
    b = 100 + 60 * np.sin(9 * x * y + 1) + 40 * ((x * 40).astype(np.int32) % 2)
    img = np.stack(np.broadcast_arrays(r, g, b), axis=-1) + rng.normal(0, 6, (height, width, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def photo_jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photo(width, height, seed)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def best_of(fn: Callable[[], object], repeats: int, *, warmup: bool = True) -> float:
    """The fastest of `repeats` timed calls of `fn`, in seconds (after one untimed call)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
