"""Bad input: each gets the right `ImageError` subclass with a message a user can act on, limits
are enforced from the header, and no Pillow warning escapes."""

from __future__ import annotations

import io
import struct
import threading
import warnings
import zlib

import numpy as np
import pytest
from hostile_corpus import hostile_corpus
from PIL import Image, features

from vision import (
    ImageDecodeError,
    ImageError,
    ImageOptions,
    ImageOptionsError,
    ImageTooLargeError,
    Limits,
    UnsupportedMediaError,
    count_tokens,
    plan_image,
    preprocess_image,
)
from vision.decode import accepted_formats
from vision.preprocess import preprocess_patches


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(w: int, h: int) -> bytes:
    """A valid PNG header for a w x h grayscale image whose pixel data is missing."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 10)) + _chunk(
        b"IEND", b""
    )


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _jpeg(w: int = 64, h: int = 48) -> bytes:
    rng = np.random.default_rng(0)
    return _encode(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), "JPEG")


def _gif_frames(n: int) -> bytes:
    frames = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(n)]
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])


def _corrupt_png_idat() -> bytes:
    data = bytearray(_encode(Image.new("RGB", (64, 64), (10, 20, 30)), "PNG"))
    start = data.index(b"IDAT") + 4
    data[start : start + 8] = b"\xff" * 8  # breaks the zlib stream (and the CRC)
    return bytes(data)


BAD_INPUTS = {
    "empty": (b"", ImageDecodeError, "empty"),
    "random bytes": (bytes(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8)), ImageDecodeError,
                     "not a recognised image"),
    "text": (b"hello, this is not an image\n" * 10, ImageDecodeError, "not a recognised image"),
    "truncated jpeg": (_jpeg()[:400], ImageDecodeError, "truncated or corrupt"),
    "png signature only": (b"\x89PNG\r\n\x1a\n", ImageDecodeError, "corrupt PNG header"),
    "png cut inside the header": (_encode(Image.new("L", (9, 9)), "PNG")[:20], ImageDecodeError, "truncated"),
    "png corrupt pixel data": (_corrupt_png_idat(), ImageDecodeError, "truncated or corrupt"),
    "png zero width": (png_header_only(0, 10), ImageDecodeError, "corrupt PNG header"),
    "gif cut after the header": (_encode(Image.new("L", (9, 9)), "GIF")[:14], ImageDecodeError, "corrupt"),
    "png header, pixels missing": (png_header_only(300, 200), ImageDecodeError, "truncated or corrupt"),
    "eps (not an accepted format)": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", ImageDecodeError,
                                     "accepted formats"),
    "80 MP header": (png_header_only(10000, 8000), ImageTooLargeError, "pixel limit"),
    "400 MP header (Pillow's bomb size)": (png_header_only(20000, 20000), ImageTooLargeError, "limit"),
    "mp4 video": (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + b"\x00" * 64, UnsupportedMediaError,
                  "video"),
    "quicktime video": (b"\x00\x00\x00\x14ftypqt  \x00\x00\x00\x00qt  " + b"\x00" * 64, UnsupportedMediaError,
                        "video"),
    "webm video": (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01" + b"\x00" * 64, UnsupportedMediaError, "video"),
    "avi video": (b"RIFF\x00\x10\x00\x00AVI LIST" + b"\x00" * 64, UnsupportedMediaError, "video"),
    "wav audio": (b"RIFF\x00\x10\x00\x00WAVEfmt " + b"\x00" * 64, ImageDecodeError, "audio"),
    "pdf": (b"%PDF-1.7\n" + b"\x00" * 64, ImageDecodeError, "PDF"),
}
# Inputs whose header is sound; only decoding the pixels finds the problem.
PIXEL_DATA_PROBLEMS = {"png corrupt pixel data", "png header, pixels missing"}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
@pytest.mark.parametrize("preprocess", [preprocess_image, preprocess_patches], ids=lambda f: f.__name__)
def test_bad_input_gets_the_right_error(name: str, preprocess) -> None:
    data, error, words = BAD_INPUTS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(error, match=words) as info:
            preprocess(data)
    assert isinstance(info.value, ImageError) and isinstance(info.value, ValueError)
    e = info.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), "no chained library error"
    assert not caught, [str(w.message) for w in caught]
    if name in PIXEL_DATA_PROBLEMS:
        assert count_tokens(data) > 0, "the header alone is fine"
    else:  # everything decided from the header is refused by the header-only count too
        with pytest.raises(error, match=words):
            count_tokens(data)


def _outcome(preprocess, data) -> tuple[str, str | bytes]:
    try:
        return "ok", preprocess(data).image.tobytes()
    except ImageError as e:
        return type(e).__name__, str(e)


def test_a_memoryview_reads_as_its_bytes() -> None:
    """An encoder worker gets a large payload as a memoryview of shared memory, which is read in
    place (never copied whole): every bad input and every hostile case gets the same answer from
    it as from the bytes, the same error or the same pixels."""
    cases = [(name, data) for name, (data, _, _) in BAD_INPUTS.items()] + [(c.name, c.data) for c in hostile_corpus()]
    for name, data in cases:
        view = memoryview(np.frombuffer(data, np.uint8).copy())  # writable, as a shared-memory tensor's is
        assert _outcome(preprocess_image, view) == _outcome(preprocess_image, data), name


@pytest.mark.parametrize("preprocess", [preprocess_image, preprocess_patches], ids=lambda f: f.__name__)
def test_a_plan_of_other_bytes_or_options_is_the_callers_bug(preprocess) -> None:
    """`plan=` is checked against the header: another image's plan (another size, mode or options)
    is a ValueError that is not an ImageError (the input is fine), never a result built by it."""
    rgb = _encode(Image.new("RGB", (56, 56), (1, 2, 3)), "PNG")
    assert preprocess(rgb, plan=plan_image(rgb))  # its own plan
    mismatches = [
        (rgb, ImageOptions(), plan_image(_encode(Image.new("RGB", (84, 28)), "PNG"))),
        (rgb, ImageOptions(max_tokens=1), plan_image(rgb)),
        (_encode(Image.new("RGBA", (56, 56)), "PNG"), ImageOptions(), plan_image(rgb)),
    ]
    for data, options, plan in mismatches:
        with pytest.raises(ValueError, match="is not this image's") as info:
            preprocess(data, options, plan=plan)
        assert not isinstance(info.value, ImageError)


def test_video_refusal_names_why() -> None:
    with pytest.raises(UnsupportedMediaError, match="still images only"):
        preprocess_image(BAD_INPUTS["mp4 video"][0])


@pytest.mark.skipif(not features.check("avif"), reason="this Pillow build has no AVIF codec")
def test_avif_brand_is_not_mistaken_for_video() -> None:
    data = _encode(Image.new("RGB", (30, 20), (200, 10, 10)), "AVIF")
    assert data[4:12] == b"ftypavif"
    assert preprocess_image(data).orig_size == (30, 20)


@pytest.mark.parametrize(
    ("limits", "data", "words"),
    [
        (Limits(max_bytes=100), _jpeg(), "per-image byte limit"),
        (Limits(max_pixels=1000), _jpeg(64, 48), "pixel limit"),
        (Limits(max_side=50), _jpeg(64, 10), "longest side"),
        (Limits(max_frames=2), _gif_frames(3), "frame limit"),
    ],
)
def test_each_limit(limits: Limits, data: bytes, words: str) -> None:
    for preprocess in (preprocess_image, preprocess_patches, count_tokens):
        with pytest.raises(ImageTooLargeError, match=words):
            preprocess(data, limits=limits)


def test_limits_at_the_boundary_pass() -> None:
    data = _gif_frames(3)
    limits = Limits(max_bytes=len(data), max_pixels=64, max_side=8, max_frames=3)
    assert preprocess_image(data, limits=limits).orig_size == (8, 8)


def test_pillow_bomb_warning_does_not_leak_when_limits_allow_the_size() -> None:
    # 9500 x 9500 = 90.25 MP: above Pillow's warning threshold (~89.5 MP), allowed by these limits.
    data = png_header_only(9500, 9500)
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert count_tokens(data, limits=Limits(max_pixels=100_000_000)) > 0
    assert not caught, [str(w.message) for w in caught]
    assert warnings.filters == filters_before


def test_concurrent_calls_leave_the_warning_filters_as_they_were() -> None:
    data = _encode(Image.new("RGBA", (200, 100), (1, 2, 3, 100)), "PNG")
    filters_before = list(warnings.filters)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                preprocess_image(data)
                with pytest.raises(ImageDecodeError):
                    preprocess_image(b"junk")
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert warnings.filters == filters_before


def test_non_bytes_input_is_a_programming_error() -> None:
    with pytest.raises(TypeError):
        preprocess_image("photo.jpg")  # type: ignore[arg-type]


def test_bad_options_are_refused() -> None:
    data = _jpeg()
    with pytest.raises(ImageOptionsError, match="resize"):
        preprocess_image(data, ImageOptions(resize="bilinear"))  # type: ignore[arg-type]
    with pytest.raises(ImageOptionsError, match="max_tokens"):
        count_tokens(data, ImageOptions(max_tokens=0))


def _psd(w: int = 4, h: int = 3) -> bytes:
    """A minimal Photoshop file: header, empty colour-mode, resource and layer sections, raw RGB."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, h, w, 8, 3)
    return header + struct.pack(">III", 0, 0, 0) + struct.pack(">H", 0) + bytes(3 * w * h)


def _cur() -> bytes:
    """A Windows cursor: an ICO with a BMP entry and the cursor type in its header."""
    ico = _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "ICO", sizes=[(16, 16)], bitmap_format="bmp")
    return ico[:2] + b"\x02\x00" + ico[4:]


REFUSED_FORMATS = {
    "TGA": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "TGA"),
    "PSD": _psd,
    "QOI": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "QOI"),
    "ICNS": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "ICNS"),
    "CUR": _cur,
    "PCX": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "PCX"),
    "SGI": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "SGI"),
    "DDS": lambda: _encode(Image.new("RGB", (16, 16), (1, 2, 3)), "DDS"),
}


@pytest.mark.parametrize("fmt", sorted(REFUSED_FORMATS))
def test_a_refused_format_is_named_with_the_accepted_list(fmt: str) -> None:
    """Pillow reads these, the service does not: the message says which format it is and what is
    accepted, rather than calling the file unrecognisable."""
    data = REFUSED_FORMATS[fmt]()
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == fmt  # the bytes really are that format
    expected = f"{fmt} images are not accepted (accepted formats: {', '.join(accepted_formats())})"
    for call in (preprocess_image, count_tokens):
        with pytest.raises(ImageDecodeError) as info:
            call(data)
        assert str(info.value) == expected
