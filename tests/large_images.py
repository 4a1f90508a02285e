"""Images for the per-image limit tests: large to the byte limit, small to the tower.

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


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
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
