"""Write the small sample images in this folder (deterministic; run from anywhere).

    python samples/make_samples.py

Each covers a case the preprocessing must get right: a JPEG photo, an RGBA PNG with soft
transparent edges (checkerboard compositing), a palette PNG with a transparency table, a
grayscale PNG, a strip wider than 7,168 px (forces a resize), and an animated GIF (first frame).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent


def _photo(w: int, h: int) -> np.ndarray:
    """A smooth sky-and-ground scene with a sun: JPEG-friendly, recognisable in a preview."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    sky = np.stack([90 + 80 * y / h, 140 + 60 * y / h, 230 - 30 * y / h], axis=-1)
    ground = np.stack([60 + 40 * x / w, 120 + 30 * np.sin(x / 23.0), 50 + 0 * x], axis=-1)
    img = np.where((y > h * 0.62)[..., None], ground, sky)
    sun = (x - w * 0.72) ** 2 + (y - h * 0.28) ** 2 < (h * 0.11) ** 2
    img[sun] = (250, 220, 90)
    return img.clip(0, 255).astype(np.uint8)


def _sticker(size: int) -> np.ndarray:
    """A red disc with a soft edge on a fully transparent background."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    r = np.hypot(x - size / 2, y - size / 2)
    alpha = np.clip((size * 0.4 - r) * 16, 0, 255)
    rgba = np.zeros((size, size, 4), np.uint8)
    rgba[..., 0], rgba[..., 1], rgba[..., 2] = 220, 40 + (x * 0.5).astype(np.uint8), 60
    rgba[..., 3] = alpha.astype(np.uint8)
    return rgba


def main() -> None:
    Image.fromarray(_photo(640, 480)).save(HERE / "photo.jpg", quality=85)
    Image.fromarray(_sticker(192)).save(HERE / "sticker_rgba.png", optimize=True)

    palette = Image.fromarray(_photo(200, 120)).quantize(16)
    transparency = bytes([0] + [255] * 15)  # palette entry 0 fully transparent
    palette.save(HERE / "palette_transparent.png", transparency=transparency, optimize=True)

    gray = Image.fromarray(_photo(300, 200)).convert("L")
    gray.save(HERE / "grayscale.png", optimize=True)

    strip = _photo(8000, 48)
    Image.fromarray(strip).quantize(32).convert("RGB").save(HERE / "wide_strip.png", optimize=True)

    frames = [Image.fromarray(np.roll(_photo(96, 64), 12 * k, axis=1)).quantize(32) for k in range(4)]
    frames[0].save(HERE / "animated.gif", save_all=True, append_images=frames[1:], duration=120, loop=0)

    total = sum(p.stat().st_size for p in HERE.iterdir() if p.suffix in (".jpg", ".png", ".gif"))
    print(f"wrote samples to {HERE} ({total / 1024:.0f} KiB of images)")


if __name__ == "__main__":
    main()
