"""resize="fast": OpenCV for 8-bit RGB/L/RGBA/LA images that need a resize; close to, not equal to,
the exact path, with the same sizes, tokens and compositing rule."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vision import ImageOptions, preprocess_image


def _strip(mode: str) -> bytes:
    rng = np.random.default_rng(3)
    w, h = 7400, 40  # wider than 7,168: forces a resize
    x = np.linspace(0, 255, w)[None, :, None]
    base = np.clip(x + rng.normal(0, 10, (h, w, 4)), 0, 255).astype(np.uint8)
    base[..., 3] = np.where(np.arange(w)[None, :] % 500 < 250, 255, 40)
    im = Image.fromarray(base, "RGBA").convert(mode)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "LA"])
def test_fast_resize_is_close_and_keeps_the_geometry(mode: str) -> None:
    data = _strip(mode)
    exact = preprocess_image(data)
    fast = preprocess_image(data, ImageOptions(resize="fast"))
    assert exact.size != exact.orig_size, "the case must need a resize"
    for key in ("orig_size", "size", "padded_size", "grid_thw", "num_tokens", "prompt"):
        assert getattr(fast, key) == getattr(exact, key)
    diff = np.abs(fast.image.astype(np.int16) - exact.image.astype(np.int16))
    # Small on average; at hard alpha edges bicubic rings where INTER_AREA does not (max ~17 here).
    assert diff.mean() < 1.0 and diff.max() <= 32
    assert not np.array_equal(fast.image, exact.image), "fast really takes the OpenCV path"
    w, h = exact.size
    assert (fast.image[h:] == 0).all() and (fast.image[:, w:] == 0).all()


def test_fast_resize_leaves_palette_images_on_the_exact_path() -> None:
    im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 7300, 3), dtype=np.uint8)).quantize(16)
    buf = io.BytesIO()
    im.save(buf, "PNG", transparency=0)
    data = buf.getvalue()
    fast = preprocess_image(data, ImageOptions(resize="fast"))
    np.testing.assert_array_equal(fast.image, preprocess_image(data).image)


def test_fast_without_a_resize_is_exact() -> None:
    buf = io.BytesIO()
    Image.new("RGBA", (300, 200), (10, 200, 30, 128)).save(buf, "PNG")
    data = buf.getvalue()
    fast = preprocess_image(data, ImageOptions(resize="fast"))
    np.testing.assert_array_equal(fast.image, preprocess_image(data).image)
