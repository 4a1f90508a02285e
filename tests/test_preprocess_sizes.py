"""The NaViT size rule: the worked examples of docs/MODEL.md §5, a property test, the max_tokens
cap, and header-only counting against the full path."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from k3_reference import reference_size
from PIL import Image

from vision import ImageOptions, ImageOptionsError, Limits, count_tokens, plan_size, preprocess_image
from vision.navit import MAX_REFERENCE_TOKENS


@pytest.mark.parametrize(
    ("w", "h", "tokens"),
    [
        (4000, 3000, 15444),
        (1920, 1080, 2691),
        (512, 512, 361),
        (225, 223, 72),
        (1, 1, 1),
        (8000, 8000, 16641),
        (7168, 7168, 16384),
        (1860, 7040, 16817),
    ],
)
def test_worked_examples(w: int, h: int, tokens: int) -> None:
    assert plan_size(w, h).num_tokens == tokens


def test_worked_example_details() -> None:
    plan = plan_size(1860, 7040)
    assert plan.size == (1849, 7001)
    assert plan.grid_thw == (1, 502, 134)
    # Float rounding: 7168/100000 * 100000 is just under 7168.
    assert plan_size(100000, 1).size == (7167, 1)
    assert plan_size(4000, 3000).padded_size == (4004, 3024)


@settings(max_examples=400, deadline=None)
@given(w=st.integers(1, 200_000), h=st.integers(1, 200_000))
def test_size_rule_properties(w: int, h: int) -> None:
    plan = plan_size(w, h)
    nw, nh = plan.size
    pw, ph = plan.padded_size
    assert plan.size == reference_size(w, h)
    assert 1 <= nw <= min(w, 7168) and 1 <= nh <= min(h, 7168), "never upscaled, sides <= 7168"
    assert pw % 28 == 0 and ph % 28 == 0 and nw <= pw < nw + 28 and nh <= ph < nh + 28
    # The 65,536-patch budget holds before padding, in the rule's own terms: the area scale
    # (nw/w)*(nh/h) times the source's floor-divided patch count. (Patches of the resized image
    # can slightly exceed 65,536 -- e.g. 2873x5117 -> 192x342 patches -- and padding adds more.)
    assert nw * nh * max(1, w // 14) * max(1, h // 14) <= 65536 * w * h * (1 + 1e-12)
    assert plan.num_tokens == (pw // 28) * (ph // 28) <= MAX_REFERENCE_TOKENS
    assert plan.grid_thw == (1, ph // 14, pw // 14)


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 50_000), h=st.integers(1, 50_000), cap=st.integers(1, 20_000))
def test_max_tokens_is_a_strict_cap_that_keeps_the_reference_when_it_fits(w: int, h: int, cap: int) -> None:
    reference = plan_size(w, h)
    capped = plan_size(w, h, max_tokens=cap)
    assert capped.num_tokens <= cap
    if reference.num_tokens <= cap:
        assert capped == reference
    else:
        assert capped.size[0] <= reference.size[0] and capped.size[1] <= reference.size[1]


def _png(w: int, h: int, mode: str = "RGB", **save) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), 90).save(buf, "PNG", **save)
    return buf.getvalue()


def _jpeg_with_orientation(w: int, h: int, orientation: int) -> bytes:
    im = Image.fromarray(np.arange(w * h * 3, dtype=np.uint8).reshape(h, w, 3))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("transpose", [False, True])
def test_exif_orientation_option(orientation: int, transpose: bool) -> None:
    data = _jpeg_with_orientation(60, 30, orientation)
    out = preprocess_image(data, ImageOptions(exif_transpose=transpose))
    swapped = transpose and orientation >= 5
    assert out.orig_size == ((30, 60) if swapped else (60, 30))
    assert out.prompt.startswith(f"<|media_begin|>image {out.orig_size[0]}x{out.orig_size[1]}")
    assert count_tokens(data, ImageOptions(exif_transpose=transpose)) == out.num_tokens
    if transpose:
        with Image.open(io.BytesIO(data)) as im:
            from PIL import ImageOps

            expected = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        np.testing.assert_array_equal(out.image[: expected.shape[0], : expected.shape[1]], expected)


def _png_with_exif_after_idat(w: int, h: int, orientation: int) -> bytes:
    import struct
    import zlib

    exif = Image.Exif()
    exif[0x0112] = orientation
    body = exif.tobytes()[6:] if exif.tobytes().startswith(b"Exif\x00\x00") else exif.tobytes()
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    data = _png(w, h)
    end = data.rindex(b"IEND") - 4
    return data[:end] + chunk + data[end:]


def test_png_exif_after_the_pixels_is_found_without_decoding() -> None:
    data = _png_with_exif_after_idat(70, 20, 6)
    full = preprocess_image(data, ImageOptions(exif_transpose=True))
    assert full.orig_size == (20, 70)
    assert count_tokens(data, ImageOptions(exif_transpose=True)) == full.num_tokens
    assert preprocess_image(data).orig_size == (70, 20), "off by default (reference behaviour)"


@pytest.mark.parametrize(("w", "h"), [(1, 1), (27, 29), (7300, 3), (3, 7300), (640, 480)])
def test_count_tokens_equals_full_path(w: int, h: int) -> None:
    data = _png(w, h)
    for cap in (None, 1, 5):
        options = ImageOptions(max_tokens=cap)
        assert count_tokens(data, options) == preprocess_image(data, options).num_tokens


def test_count_tokens_does_not_decode_pixels() -> None:
    # A header claiming 6000x6000 followed by truncated pixel data: the count works from the
    # header, the full path reports the truncation.
    data = _png(6000, 6000, "L")[:2000]
    assert count_tokens(data) == plan_size(6000, 6000).num_tokens
    from vision import ImageDecodeError

    with pytest.raises(ImageDecodeError, match="truncated"):
        preprocess_image(data)


def test_max_tokens_option_end_to_end() -> None:
    data = _png(1000, 700)
    out = preprocess_image(data, ImageOptions(max_tokens=100))
    assert out.num_tokens <= 100 and out.pixel_values.shape[0] == out.num_tokens * 4
    assert out.prompt.startswith("<|media_begin|>image 1000x700<|media_content|>")


def test_options_key_is_stable_and_distinguishes_options() -> None:
    assert ImageOptions().key() == ImageOptions(max_tokens=None, exif_transpose=False, resize="exact").key()
    assert ImageOptions().key() == "kimi-k3-image/v1;max_tokens=None;exif_transpose=0;resize=exact"  # cache keys
    keys = {ImageOptions().key(), ImageOptions(max_tokens=10).key(), ImageOptions(exif_transpose=True).key(),
            ImageOptions(resize="fast").key()}
    assert len(keys) == 4
    with pytest.raises(ImageOptionsError):
        ImageOptions(resize="nearest")  # type: ignore[arg-type]
    with pytest.raises(ImageOptionsError, match="max_tokens"):
        ImageOptions(max_tokens=True)


def test_limits_validate_themselves() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        Limits(max_pixels=0)
