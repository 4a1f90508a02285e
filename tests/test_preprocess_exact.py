"""Bit-exactness of the project path against the plain reference (tests/k3_reference.py), on
generated images of every Pillow mode the reference meets, with and without a resize."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3_reference import reference_preprocess
from PIL import Image

from vision import preprocess_image
from vision.preprocess import COMPOSITE_TABLE, NORMALISE_TABLE, preprocess_patches

# Small sizes take the no-resize path; strips longer than 7168 px force a resize cheaply.
SIZES = [(53, 37), (7300, 23), (19, 7250)]


def _pattern(w: int, h: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: exercises the bicubic filter and every value range."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), (x * 7 + y * 13) % 256], axis=-1)
    return np.clip(base + rng.integers(-40, 41, base.shape), 0, 255).astype(np.uint8)


def _alpha(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    a = rng.integers(0, 256, (h, w)).astype(np.uint8)
    a[: h // 3] = 0  # fully transparent rows
    a[h // 3 : h // 2] = 255  # fully opaque rows
    return a


def _palette(rgb: np.ndarray) -> Image.Image:
    """A 64-colour palette image built directly (quantize() is slow on long strips)."""
    levels = (rgb // 64).astype(np.uint8)
    index = levels[..., 0] * 16 + levels[..., 1] * 4 + levels[..., 2]
    im = Image.fromarray(index, "P")
    r, g, b = np.meshgrid(np.arange(4), np.arange(4), np.arange(4), indexing="ij")
    colours = np.stack([r, g, b], axis=-1).reshape(-1, 3) * 64 + 32
    im.putpalette(colours.astype(np.uint8).tobytes())
    return im


def _save(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def make_image(kind: str, w: int, h: int, seed: int = 0) -> bytes:
    rgb = _pattern(w, h, seed)
    a = _alpha(w, h, seed)
    gray = rgb[:, :, 0]
    if kind == "RGB":
        return _save(Image.fromarray(rgb), "PNG")
    if kind == "RGB-jpeg":
        return _save(Image.fromarray(rgb), "JPEG", quality=90)
    if kind == "RGB-tRNS":  # RGB with a transparent colour: the reference returns it as is
        return _save(Image.fromarray(rgb), "PNG", transparency=tuple(int(v) for v in rgb[0, 0]))
    if kind == "RGBA":
        return _save(Image.fromarray(np.dstack([rgb, a])), "PNG")
    if kind == "LA":
        return _save(Image.fromarray(np.dstack([gray, a])), "PNG")
    if kind == "L":
        return _save(Image.fromarray(gray), "PNG")
    if kind == "L-tRNS":
        return _save(Image.fromarray(gray), "PNG", transparency=int(gray[0, 0]))
    if kind in ("P", "P-tRNS"):
        im = _palette(rgb)
        if kind == "P":
            return _save(im, "PNG")
        alphas = bytes(range(0, 256, 4))[:64]
        return _save(im, "PNG", transparency=alphas)
    if kind == "P-gif-transparent":
        return _save(_palette(rgb), "GIF", transparency=3)
    if kind == "1":
        return _save(Image.fromarray(gray > 127), "PNG")
    if kind == "CMYK-jpeg":
        return _save(Image.frombytes("CMYK", (w, h), np.dstack([rgb, gray]).tobytes()), "JPEG", quality=92)
    if kind == "CMYK-tiff":
        return _save(Image.frombytes("CMYK", (w, h), np.dstack([rgb, 255 - gray]).tobytes()), "TIFF")
    if kind == "I;16":
        v = (gray.astype(np.uint16) * 257 + np.uint16(seed)).astype(np.uint16)
        return _save(Image.fromarray(v), "PNG")
    if kind == "I":
        v = gray.astype(np.int32) * 3 - 100  # values outside 0..255 exercise the conversion's clipping
        return _save(Image.frombytes("I", (w, h), v.tobytes()), "TIFF")
    if kind == "F":
        v = gray.astype(np.float32) * 1.5 - 50.25
        return _save(Image.frombytes("F", (w, h), v.tobytes()), "TIFF")
    frames_rgb = [_pattern(w, h, seed + k) for k in range(3)]
    if kind == "GIF-animated":
        frames = [_palette(f) for f in frames_rgb]
        return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0, transparency=5)
    if kind == "APNG":
        frames = [Image.fromarray(np.dstack([f, a])) for f in frames_rgb]
        return _save(frames[0], "PNG", save_all=True, append_images=frames[1:], duration=50)
    if kind == "WEBP-animated":
        frames = [Image.fromarray(np.dstack([f, a])) for f in frames_rgb]
        return _save(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50, lossless=True)
    if kind == "TIFF-multipage":
        frames = [Image.fromarray(f) for f in frames_rgb]
        return _save(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    raise AssertionError(kind)


KINDS = [
    "RGB", "RGB-jpeg", "RGB-tRNS", "RGBA", "LA", "L", "L-tRNS", "P", "P-tRNS", "P-gif-transparent", "1",
    "CMYK-jpeg", "CMYK-tiff", "I;16", "I", "F", "GIF-animated", "APNG", "WEBP-animated", "TIFF-multipage",
]
EXPECTED_MODE = {
    "RGB": "RGB", "RGB-jpeg": "RGB", "RGB-tRNS": "RGB", "RGBA": "RGBA", "LA": "LA", "L": "L", "L-tRNS": "L",
    "P": "P", "P-tRNS": "P", "P-gif-transparent": "P", "1": "1", "CMYK-jpeg": "CMYK", "CMYK-tiff": "CMYK",
    "I;16": "I;16", "I": "I", "F": "F", "GIF-animated": "P", "APNG": "RGBA", "WEBP-animated": "RGBA",
    "TIFF-multipage": "RGB",
}


def assert_matches_reference(data: bytes) -> None:
    ref = reference_preprocess(data)
    got = preprocess_image(data)
    for key in ("orig_size", "size", "padded_size", "grid_thw", "num_tokens", "prompt"):
        assert getattr(got, key) == ref[key], key
    assert got.image.dtype == np.uint8 and got.image.flags.c_contiguous
    np.testing.assert_array_equal(got.image, ref["image"])
    pv = got.pixel_values
    assert pv.dtype == np.float32 and pv.shape == ref["pixel_values"].shape and pv.flags.c_contiguous
    # Bitwise, not approximately: compare the float32 bit patterns.
    ref_bits = np.ascontiguousarray(ref["pixel_values"]).view(np.uint32)
    assert np.array_equal(pv.view(np.uint32), ref_bits)
    plan, patches = preprocess_patches(data)  # the same patches, never building the padded image
    for key in ("orig_size", "size", "padded_size", "grid_thw", "num_tokens", "prompt"):
        assert getattr(plan, key) == ref[key], key
    assert patches.shape == pv.shape and patches.flags.c_contiguous
    assert np.array_equal(patches.view(np.uint32), ref_bits)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_bit_exact_against_reference(kind: str, size: tuple[int, int]) -> None:
    data = make_image(kind, *size)
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == EXPECTED_MODE[kind], "the generator must produce the mode under test"
    assert_matches_reference(data)


def test_transparent_pixels_become_the_checkerboard() -> None:
    data = make_image("RGBA", 53, 37)
    out = preprocess_image(data).image
    # Rows 0..11 are fully transparent: pure checkerboard, top-left square white, neighbours gray.
    assert (out[0, 0] == 255).all() and (out[0, 8] == 180).all() and (out[8, 0] == 180).all()
    assert (out[8, 8] == 255).all()
    assert (out[:, 53:] == 0).all() and (out[37:] == 0).all(), "padding is black, never checkerboard"


def test_normalise_table_matches_both_readings_of_the_spec() -> None:
    x = np.arange(256, dtype=np.uint8)
    literal = ((x / 255.0).astype(np.float32) - np.array([0.5]) * 1.0) * (1.0 / np.array([0.5]))
    inplace = x.astype(np.float32) / 255.0  # the in-place float32 form some ports use
    inplace -= np.array([0.5])
    inplace *= 1.0 / np.array([0.5])
    assert np.array_equal(NORMALISE_TABLE.view(np.uint32), literal.astype(np.float32).view(np.uint32))
    assert np.array_equal(NORMALISE_TABLE.view(np.uint32), inplace.view(np.uint32))
    assert NORMALISE_TABLE[0] == -1.0 and NORMALISE_TABLE[255] == 1.0


def test_composite_table_is_the_float32_blend_everywhere() -> None:
    a = np.arange(256, dtype=np.uint8)
    for g, bg in enumerate((255, 180)):
        for v in range(256):
            alpha = a.astype(np.float32) / 255.0
            expected = (alpha * np.uint8(v) + (1 - alpha) * np.full(256, bg, np.uint8)).astype(np.uint8)
            np.testing.assert_array_equal(COMPOSITE_TABLE[g, :, v], expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    w=st.integers(1, 90),
    h=st.integers(1, 90),
    kind=st.sampled_from(["RGB", "RGBA", "LA", "P-tRNS", "L"]),
    seed=st.integers(0, 2**16),
)
def test_bit_exact_random_sizes(w: int, h: int, kind: str, seed: int) -> None:
    assert_matches_reference(make_image(kind, w, h, seed))


@settings(max_examples=6, deadline=None)
@given(long=st.integers(7169, 9000), short=st.integers(1, 12), tall=st.booleans())
def test_bit_exact_random_resized_strips(long: int, short: int, tall: bool) -> None:
    w, h = (short, long) if tall else (long, short)
    assert_matches_reference(make_image("RGBA", w, h, long))


# --- reading Pillow's pixels without tobytes ---------------------------------------------------
def test_pixels_view_is_pillows_own_memory() -> None:
    from vision.preprocess import _pixels_view

    rgb = np.random.default_rng(4).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    view = _pixels_view(image)
    assert view is not None and view.shape == (50, 70, 4) and not view.flags.writeable
    assert np.array_equal(view[:, :, :3], rgb)
    del image
    assert np.array_equal(view[:, :, :3], rgb), "the view keeps Pillow's memory alive"


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_images_in_several_blocks_are_read_in_bands(mode: str) -> None:
    from k3_reference import reference_fill

    from vision.preprocess import _patches_of, _PixelRows, _pixels_view, _to_padded_rgb, patchify_normalise

    pixels = np.random.default_rng(5).integers(0, 256, (2100, 2100, len(mode)), dtype=np.uint8)
    pixels[:300, :, -1] = 0 if mode == "RGBA" else pixels[:300, :, -1]  # transparent rows: checkerboard
    image = Image.fromarray(pixels, mode).copy()  # 17.6 MB in Pillow's own memory: over its 16 MiB block
    assert _pixels_view(image) is None, "the case must need bands"
    rows = _PixelRows(image)
    rows(0, 1)
    band = rows.band.shape[0]
    assert 1 < band < 2100 and band % 8 != 0 and band % 14 != 0, "band edges must cut squares and patch rows"
    out = _to_padded_rgb(image, (2114, 2128))
    assert np.array_equal(out[:2100, :2100], reference_fill(image))
    assert not out[2100:].any() and not out[:, 2100:].any()
    # Straight from Pillow's bands to the patches, padding included: what the padded image gives.
    patches = _patches_of(image, (2114, 2128), None)
    assert np.array_equal(patches.view(np.uint32), patchify_normalise(out).view(np.uint32))


@pytest.mark.parametrize("kind", ["RGB", "RGBA", "P-tRNS"])
def test_a_pillow_without_arrow_export_gives_the_same_model_input(kind: str, monkeypatch) -> None:
    # Older Pillows have no `__arrow_c_array__`: every band is then a `tobytes` copy (3 bytes per
    # pixel for RGB, 4 for RGBA), which both the padded image and the patches path must read.
    import vision.preprocess as pp

    monkeypatch.setattr(pp, "_pixels_view", lambda image: None)
    monkeypatch.setattr(pp, "_ROW_BAND_BYTES", 4 * 300 * 5)  # bands of 5 rows: many, cutting patch rows
    assert_matches_reference(make_image(kind, 300, 97))
