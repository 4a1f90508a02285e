"""Bounded fuzzing of the decode/preprocess path with hypothesis.

Inputs: arbitrary bytes; valid small images of every accepted format with bytes flipped,
inserted, deleted, overwritten and truncated; and PNG/BMP/GIF headers with arbitrary field
values. Properties: only `vision.ImageError` subclasses escape (with a message); a success is a
well-formed model input whose token count equals the header-only `count_tokens`; a limit is never
exceeded. CI runs a bounded number of examples (well under a minute); set KIMI_FUZZ_EXAMPLES for
a longer run, e.g. `KIMI_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_fuzz.py`.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import zlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from vision import ImageError, Limits, count_tokens, preprocess_image

EXAMPLES = int(os.environ.get("KIMI_FUZZ_EXAMPLES", "150"))
# Small limits keep each example fast: a mutated header may declare any size, and a 64 MP
# canvas would be allocated before its (missing) data is found missing.
LIMITS = Limits(max_bytes=1 << 20, max_pixels=1 << 20, max_side=4096, max_frames=64)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def seeds() -> tuple[bytes, ...]:
    """One small valid image per accepted format and a few modes."""
    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (19, 29, 4), dtype=np.uint8))

    def enc(im: Image.Image, fmt: str, **kw: object) -> bytes:
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        return buf.getvalue()

    frames = [rgb.convert("P"), rgb.rotate(90).convert("P")]
    return (
        enc(rgb, "PNG"), enc(rgba, "PNG"), enc(rgb.convert("P"), "PNG", transparency=3), enc(rgb.convert("L"), "PNG"),
        enc(rgb, "JPEG", quality=80), enc(rgb, "JPEG", progressive=True), enc(rgb.convert("CMYK"), "JPEG"),
        enc(frames[0], "GIF", save_all=True, append_images=frames[1:]), enc(rgb, "WEBP", quality=70),
        enc(rgba, "WEBP", lossless=True), enc(rgb, "TIFF"), enc(rgb, "TIFF", compression="tiff_deflate"),
        enc(rgb, "BMP"), enc(rgb.convert("P"), "BMP"), enc(rgba, "PNG", save_all=True,
                                                           append_images=[rgba.rotate(180)]),  # APNG
        enc(rgb, "PPM"), enc(rgb.resize((16, 16)), "ICO"),
    )


def check(data: bytes) -> None:
    """The fuzz property for one input."""
    try:
        pre = preprocess_image(data, limits=LIMITS)
    except ImageError as exc:
        assert str(exc), "an ImageError needs a message"
        return
    w, h = pre.orig_size
    assert 1 <= w <= LIMITS.max_side and 1 <= h <= LIMITS.max_side and w * h <= LIMITS.max_pixels
    pw, ph = pre.padded_size
    assert pw % 28 == 0 and ph % 28 == 0
    assert pre.image.shape == (ph, pw, 3) and pre.image.dtype == np.uint8
    assert pre.num_tokens == (pw // 28) * (ph // 28) == pre.grid_thw[1] * pre.grid_thw[2] // 4
    assert count_tokens(data, limits=LIMITS) == pre.num_tokens


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data: bytes) -> None:
    check(data)


_edit = st.tuples(st.sampled_from(["flip", "insert", "delete", "overwrite", "truncate"]),
                  st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=16))


def mutate(data: bytes, edits: list[tuple[str, float, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, where, payload in edits:
        if not out:
            break
        at = int(where * len(out))
        if kind == "flip":
            out[at] ^= payload[0] or 0xFF
        elif kind == "insert":
            out[at:at] = payload
        elif kind == "delete":
            del out[at:at + len(payload)]
        elif kind == "overwrite":
            out[at:at + len(payload)] = payload
        else:
            del out[at:]
    return bytes(out)


@FUZZ
@given(st.integers(0, 10_000), st.lists(_edit, min_size=1, max_size=6))
def test_mutated_valid_images(which: int, edits: list[tuple[str, float, bytes]]) -> None:
    seed = seeds()[which % len(seeds())]
    check(seed)  # the seed itself is fine
    check(mutate(seed, edits))


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


_u32 = st.integers(0, 2**32 - 1)


@FUZZ
@given(st.sampled_from(["png", "bmp", "gif"]), _u32, _u32, st.integers(0, 255), st.integers(0, 255),
       st.binary(max_size=256))
def test_arbitrary_header_fields(fmt: str, width: int, height: int, depth: int, kind: int, body: bytes) -> None:
    if fmt == "png":
        ihdr = struct.pack(">IIBBBBB", width, height, depth, kind, 0, 0, 0)
        data = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"PLTE", bytes(range(48)))
                + _png_chunk(b"IDAT", zlib.compress(body)) + _png_chunk(b"IEND", b""))
    elif fmt == "bmp":
        info = struct.pack("<IiiHHIIiiII", 40, width - 2**31, height - 2**31, 1, depth, kind % 7, len(body), 0, 0,
                           depth, 0)
        data = b"BM" + struct.pack("<IHHI", 14 + len(info) + len(body), 0, 0, 54) + info + body
    else:
        data = (b"GIF89a" + struct.pack("<HHBBB", width & 0xFFFF, height & 0xFFFF, kind, 0, 0) + bytes(range(48))
                + b"\x2c" + struct.pack("<HHHHB", 0, 0, (width >> 16) & 0xFFFF, (height >> 16) & 0xFFFF, depth)
                + body + b"\x3b")
    check(data)
