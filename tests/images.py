"""The test images every test file makes: noise PNGs and JPEGs of a given size (each seed its own
pixels, the same on every run), and images large to the byte limit but small to the tower.

Pillow stops reading a PNG at its IEND chunk, so a small PNG followed by zeros decodes to its few
pixels (the tiny model's tower takes milliseconds on it) while the limits see its whole size.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

MIB = 1 << 20


def noise(width: int, height: int, *, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Uniform noise in every band of `mode` (L, LA, RGB, RGBA, ...)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if len(mode) == 1 else pixels, mode)


def png(width: int, height: int, *, seed: int = 0, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    noise(width, height, seed=seed, mode=mode).save(out, format="PNG")
    return out.getvalue()


def jpeg(width: int, height: int, *, seed: int = 0, quality: int = 90) -> bytes:
    out = io.BytesIO()
    noise(width, height, seed=seed).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def padded_png(total_bytes: int) -> bytes:
    """A valid 64x48 PNG followed by zeros, `total_bytes` long."""
    head = png(64, 48)
    assert total_bytes >= len(head)
    return head + bytes(total_bytes - len(head))


def limit_images(root: Path) -> Path:
    """Over the default byte limit but few pixels; within the byte limit but over a megapixel."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "35mb.png").write_bytes(padded_png(35 * MIB))
    (root / "1200x1000.png").write_bytes(png(1200, 1000))
    return root


def check_limited_rows(output: Path) -> None:
    """The rows of an embed job on `limit_images` under a 40 MiB, 1 megapixel limit: 35mb.png is read and
    embedded (the reader's and the engine's byte limits were both raised); 1200x1000.png is refused
    by the engine's pixel limit."""
    rows = {row["custom_id"]: row for row in map(json.loads, output.read_text().splitlines())}
    assert rows["35mb.png"]["response"]["status_code"] == 200, rows["35mb.png"]["error"]
    large = rows["1200x1000.png"]
    assert (large["response"]["status_code"], large["error"]["code"]) == (413, "too_large")
    assert "over the 1,000,000-pixel limit" in large["error"]["message"]
