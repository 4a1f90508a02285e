"""A corpus of hostile image inputs, generated at test time, each with its expected outcome.

Every case is built from a few bytes of Python (no files checked in). Bombs are written with
zlib from a reused block of zeros, so a 20000x20000 PNG costs about a megabyte and a few hundred
milliseconds to make and never exists as pixels on this side.

Outcomes (what a server must answer to `Preprocess`):
  - INVALID_ARGUMENT with a message matching `reason` (a regex, case-insensitive);
  - UNIMPLEMENTED for video (configured in K3 but refused by its processor); documents, audio and
    every other non-image are bad input (INVALID_ARGUMENT, naming what the bytes look like);
  - OK for valid images, whose decoded size is `size` and whose pixels equal the plain reference
    implementation in tests/k3_reference.py.
"""

from __future__ import annotations

import functools
import io
import random
import struct
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from PIL import Image

INVALID = "INVALID_ARGUMENT"
UNIMPLEMENTED = "UNIMPLEMENTED"
OK = "OK"

# What the messages say, by kind of problem.
EMPTY = r"empty"
NOT_IMAGE = r"not a recognised image"
CORRUPT = r"truncated|corrupt"
TOO_LARGE = r"pixel limit|pixels, over|longest side"
EMPTY_SIZE = r"empty size|truncated|corrupt"
FRAMES = r"frames, over"


@dataclass(frozen=True)
class HostileCase:
    name: str
    data: bytes
    expect: str  # INVALID | UNIMPLEMENTED | OK
    reason: str = ""  # regex the status message matches (INVALID / UNIMPLEMENTED)
    size: tuple[int, int] | None = None  # decoded (width, height) when OK
    bomb: bool = False  # declares far more pixels than the limits allow; must never be decoded

    def __repr__(self) -> str:  # pytest ids and failure messages: never the bytes
        return f"HostileCase({self.name!r}, {len(self.data)} bytes, expect {self.expect})"


# ---------------------------------------------------------------------------------------------
# Writers


def encode(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def pattern(w: int, h: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (h, w, channels) if channels > 1 else (h, w)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def png_chunk(kind: bytes, body: bytes, *, crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + body) if crc is None else crc
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc & 0xFFFFFFFF)


def png(width: int, height: int, color_type: int, bit_depth: int, idat: bytes,
        chunks_before: Iterable[bytes] = (), chunks_after: Iterable[bytes] = ()) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + b"".join(chunks_before) + png_chunk(b"IDAT", idat)
            + b"".join(chunks_after) + png_chunk(b"IEND", b""))


def raw_rows(rows: np.ndarray) -> bytes:
    """PNG scanlines (filter type 0) of a big-endian sample array shaped [height, row_bytes]."""
    h = rows.shape[0]
    return np.concatenate([np.zeros((h, 1), np.uint8), rows.reshape(h, -1).view(np.uint8)], axis=1).tobytes()


_BLOCK = 1 << 22


@functools.cache
def _zero_block_deflate() -> bytes:
    # Raw deflate of one block of zeros ending in a full flush: no later block refers back into
    # it, so the same bytes repeated are a valid deflate stream of that many blocks.
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(bytes(_BLOCK)) + c.flush(zlib.Z_FULL_FLUSH)


def zeros_deflate(nbytes: int) -> bytes:
    """A zlib stream that inflates to `nbytes` zeros, built without ever holding them."""
    blocks, rest = divmod(nbytes, _BLOCK)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    raw = _zero_block_deflate() * blocks + tail.compress(bytes(rest)) + tail.flush()
    adler = (nbytes % 65521) << 16 | 1  # Adler-32 of n zeros: a stays 1, b = n mod 65521
    return b"\x78\xda" + raw + struct.pack(">I", adler)


def png_zeros(width: int, height: int, color_type: int = 2, bit_depth: int = 8) -> bytes:
    """A complete, valid PNG of all-zero pixels: a compression bomb for large sizes."""
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    row_bytes = 1 + (width * channels * bit_depth + 7) // 8  # zero filter byte + zero samples
    chunks = [png_chunk(b"PLTE", b"\x00\x00\x00")] if color_type == 3 else []
    return png(width, height, color_type, bit_depth, zeros_deflate(row_bytes * height), chunks_before=chunks)


def jpeg(w: int = 64, h: int = 48, **kw: object) -> bytes:
    return encode(Image.fromarray(pattern(w, h)), "JPEG", quality=90, **kw)


def jpeg_with_size(width: int, height: int) -> bytes:
    """A real JPEG whose SOF0 frame header is rewritten to declare `width` x `height`."""
    data = bytearray(jpeg(32, 32))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def jpeg_segments(segments: Iterable[tuple[int, bytes]]) -> bytes:
    """A real small JPEG with extra APPn/COM segments inserted right after SOI."""
    base = jpeg(40, 30)
    extra = b"".join(bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body for marker, body in segments)
    return base[:2] + extra + base[2:]


def gif_with_screen(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("P", (8, 8), 1), "GIF"))
    struct.pack_into("<HH", data, 6, width, height)  # logical screen descriptor
    # and the first image descriptor (after the 13-byte header and the global colour table)
    desc = data.index(b"\x2c", 13)
    struct.pack_into("<HH", data, desc + 5, width, height)
    return bytes(data)


def gif_frames(n: int) -> bytes:
    """An n-frame 1x1 GIF written by hand (Pillow would take seconds to write thousands)."""
    header = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    loop = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    frame = (b"\x21\xf9\x04\x00\x01\x00\x00\x00"  # graphic control: 10 ms, no disposal
             + b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
             + b"\x02\x02\x44\x01\x00")  # LZW min code 2, one data block holding pixel 0
    return header + loop + frame * n + b"\x3b"


def apng_declaring_frames(num_frames: int) -> bytes:
    """A one-frame APNG whose acTL chunk declares `num_frames` frames."""
    actl = png_chunk(b"acTL", struct.pack(">II", num_frames, 0))
    fctl = png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 8, 8, 0, 0, 1, 10, 0, 0))
    rows = raw_rows(np.full((8, 8), 77, np.uint8))
    return png(8, 8, 0, 8, zlib.compress(rows), chunks_before=[actl, fctl])


def bmp(width: int, height: int, bpp: int = 24, *, compression: int = 0, pixels: bytes | None = None,
        offset: int = 54, clr_used: int = 0) -> bytes:
    """A BITMAPINFOHEADER BMP with whatever header values a case wants (negative height = top-down)."""
    if pixels is None:
        row = ((abs(width) * bpp + 31) // 32) * 4
        pixels = bytes(row * abs(height)) if abs(width) * abs(height) <= 1 << 20 else b""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bpp, compression, len(pixels), 2835, 2835, clr_used, 0)
    size = 14 + len(info) + len(pixels)
    return b"BM" + struct.pack("<IHHI", size, 0, 0, offset) + info + pixels


def tiff(width: int, height: int, *, bits: int = 8, photometric: int = 1, strip_offset: int | None = None,
         strip_bytes: int | None = None, next_ifd: int = 0, pixels: bytes | None = None) -> bytes:
    """A little-endian uncompressed single-strip TIFF, every header field chosen by the caller."""
    samples = 1
    if pixels is None:
        pixels = bytes(min(width * height * bits // 8, 1 << 16))
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, bits), (259, 3, 1, 1), (262, 3, 1, photometric),
               (273, 4, 1, 0), (277, 3, 1, samples), (278, 4, 1, height),
               (279, 4, 1, len(pixels) if strip_bytes is None else strip_bytes)]
    ifd_offset = 8
    data_offset = ifd_offset + 2 + 12 * len(entries) + 4
    out = bytearray(b"II*\x00" + struct.pack("<I", ifd_offset) + struct.pack("<H", len(entries)))
    for tag, kind, count, value in entries:
        if tag == 273:
            value = data_offset if strip_offset is None else strip_offset
        fmt = "<HHII" if kind == 4 else "<HHIHH"
        out += struct.pack(fmt, tag, kind, count, value) if kind == 4 else struct.pack(fmt, tag, kind, count, value, 0)
    out += struct.pack("<I", ifd_offset if next_ifd == -1 else next_ifd)  # -1: the IFD points back at itself
    return bytes(out + pixels)


def webp_vp8x(width: int, height: int) -> bytes:
    """A real lossless WebP wrapped in a VP8X header whose canvas declares `width` x `height`."""
    simple = encode(Image.fromarray(pattern(16, 16)), "WEBP", lossless=True)
    bitstream = simple[12:]  # the VP8L chunk
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (
        height - 1).to_bytes(3, "little")
    body = b"WEBP" + vp8x + bitstream
    return b"RIFF" + struct.pack("<I", len(body)) + body


def truncated(data: bytes, fraction: float) -> bytes:
    return data[: int(len(data) * fraction)]


def flip_byte_after(data: bytes, marker: bytes, delta: int = 8) -> bytes:
    out = bytearray(data)
    at = out.index(marker) + len(marker) + delta
    out[at] ^= 0xFF
    return bytes(out)


def with_bad_crc(data: bytes, kind: bytes) -> bytes:
    """`data` (a PNG) with the CRC of its first `kind` chunk inverted."""
    out = bytearray(data)
    at = out.index(kind) - 4
    (length,) = struct.unpack(">I", out[at:at + 4])
    crc_at = at + 8 + length
    out[crc_at:crc_at + 4] = bytes(b ^ 0xFF for b in out[crc_at:crc_at + 4])
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# The corpus


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _valid(name: str, data: bytes) -> HostileCase:
    with warnings.catch_warnings():  # Pillow warns about the odd metadata some cases carry
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as im:
            size = im.size
    return HostileCase(name, data, OK, size=size)


@functools.cache
def hostile_corpus() -> tuple[HostileCase, ...]:
    small_png = encode(Image.fromarray(pattern(64, 48)), "PNG")
    small_gif = encode(Image.fromarray(pattern(40, 30)).convert("P"), "GIF")
    small_webp = encode(Image.fromarray(pattern(64, 48)), "WEBP", quality=80)
    small_tiff = encode(Image.fromarray(pattern(64, 48)), "TIFF", compression="tiff_deflate")
    photo = jpeg(256, 192)
    gray16 = pattern(40, 30, 2).view(">u2").reshape(30, 40)  # big-endian 16-bit samples
    rgb16 = pattern(40 * 3, 30, 2).view(">u2").reshape(30, 120)
    rgba16 = pattern(40 * 4, 30, 2).view(">u2").reshape(30, 160)
    indices = np.arange(40 * 30, dtype=np.uint32).reshape(30, 40) % 256

    cases = [
        # -- not images at all ----------------------------------------------------------------
        HostileCase("empty", b"", INVALID, EMPTY),
        HostileCase("one byte", b"\xff", INVALID, NOT_IMAGE),
        HostileCase("random 4 KiB", _random_bytes(4096, 1), INVALID, NOT_IMAGE),
        HostileCase("64 KiB of zeros", bytes(65536), INVALID, NOT_IMAGE),
        HostileCase("plain text", b"hello, this is not an image\n" * 20, INVALID, NOT_IMAGE),
        HostileCase("json", b'{"image": "cat.jpg", "width": 100000}', INVALID, NOT_IMAGE),
        HostileCase("html", b"<!DOCTYPE html><html><body><img src=x onerror=alert(1)></body></html>", INVALID,
                    NOT_IMAGE),
        HostileCase("svg", b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="100000" '
                    b'height="100000"><rect width="100%" height="100%"/></svg>', INVALID, NOT_IMAGE),
        HostileCase("gzip of zeros", zlib.compress(bytes(1 << 20), 9), INVALID, NOT_IMAGE),
        HostileCase("zip archive", b"PK\x03\x04" + _random_bytes(512, 2), INVALID, NOT_IMAGE),
        HostileCase("pdf", b"%PDF-1.7\n1 0 obj << /Type /XObject /Subtype /Image >>\nendobj\n%%EOF\n", INVALID,
                    r"PDF"),
        HostileCase("mp4 video", b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + bytes(64),
                    UNIMPLEMENTED, r"video"),
        # -- truncated --------------------------------------------------------------------------
        HostileCase("jpeg: SOI only", b"\xff\xd8\xff", INVALID, CORRUPT),
        HostileCase("jpeg: cut in the headers", photo[:200], INVALID, CORRUPT),
        HostileCase("jpeg: cut mid-scan", truncated(photo, 0.5), INVALID, CORRUPT),
        HostileCase("png: signature only", b"\x89PNG\r\n\x1a\n", INVALID, CORRUPT),
        HostileCase("png: cut mid-IDAT", truncated(small_png, 0.6), INVALID, CORRUPT),
        HostileCase("webp: cut in half", truncated(small_webp, 0.5), INVALID, CORRUPT),
        HostileCase("gif: header only", small_gif[:13], INVALID, CORRUPT),
        HostileCase("gif: cut mid-frame", truncated(small_gif, 0.7), INVALID, CORRUPT),
        HostileCase("tiff: cut mid-strip", truncated(small_tiff, 0.6), INVALID, CORRUPT),
        # -- corrupt ----------------------------------------------------------------------------
        HostileCase("png: bad IHDR crc", with_bad_crc(small_png, b"IHDR"), INVALID, CORRUPT),
        HostileCase("png: broken zlib stream", flip_byte_after(small_png, b"IDAT", 2), INVALID, CORRUPT),
        # Pillow (the reference decoder) does not check IDAT CRCs; the pixels are intact, so the
        # image is accepted exactly as the reference would accept it.
        _valid("png: bad IDAT crc, intact data", with_bad_crc(small_png, b"IDAT")),
        # Pillow (the reference) decodes a palette PNG without PLTE with its default palette.
        _valid("png: palette image without PLTE", png(8, 8, 3, 8, zlib.compress(raw_rows(np.zeros((8, 8), np.uint8))))),
        HostileCase("jpeg header, png body", b"\xff\xd8\xff" + small_png, INVALID, CORRUPT),
        # -- absurd declared sizes -------------------------------------------------------------
        HostileCase("png: declares 0x0", png(0, 0, 2, 8, zlib.compress(b"")), INVALID, EMPTY_SIZE),
        HostileCase("png: declares 100000x100000", png(100000, 100000, 2, 8, zlib.compress(b"\x00" * 64)), INVALID,
                    TOO_LARGE, bomb=True),
        HostileCase("png: declares 131073x1 (side limit)", png(131073, 1, 0, 8, zlib.compress(bytes(131074))),
                    INVALID, TOO_LARGE),
        HostileCase("png: 8001x8000, just over 64 MP", png(8001, 8000, 0, 8, zlib.compress(b"\x00" * 64)),
                    INVALID, TOO_LARGE, bomb=True),
        HostileCase("jpeg: declares 0x0", jpeg_with_size(0, 0), INVALID, EMPTY_SIZE),
        HostileCase("jpeg: declares 65535x65535", jpeg_with_size(65535, 65535), INVALID, TOO_LARGE, bomb=True),
        HostileCase("gif: declares 0x0", gif_with_screen(0, 0), INVALID, EMPTY_SIZE),
        HostileCase("gif: declares 65535x65535", gif_with_screen(65535, 65535), INVALID, TOO_LARGE, bomb=True),
        HostileCase("webp: VP8X canvas 100000x100000", webp_vp8x(100000, 100000), INVALID, TOO_LARGE + "|" + CORRUPT,
                    bomb=True),
        HostileCase("bmp: 0x0", bmp(0, 0), INVALID, EMPTY_SIZE),
        HostileCase("bmp: 100000x100000", bmp(100000, 100000), INVALID, TOO_LARGE, bomb=True),
        HostileCase("bmp: width 2**31-1", bmp(2**31 - 1, 1), INVALID, TOO_LARGE, bomb=True),
        HostileCase("bmp: height -2**31", bmp(1, -(2**31)), INVALID, TOO_LARGE + "|" + CORRUPT, bomb=True),
        HostileCase("bmp: 0 bits per pixel", bmp(16, 16, 0), INVALID, CORRUPT),
        HostileCase("bmp: pixel offset past the end", bmp(64, 64, offset=1 << 30), INVALID, CORRUPT),
        HostileCase("bmp: RLE8 with garbage data", bmp(64, 64, 8, compression=1, pixels=_random_bytes(300, 3),
                    clr_used=256), INVALID, CORRUPT),
        HostileCase("tiff: 0x0", tiff(0, 0), INVALID, EMPTY_SIZE),
        HostileCase("tiff: 100000x100000", tiff(100000, 100000), INVALID, TOO_LARGE, bomb=True),
        HostileCase("tiff: 999 bits per sample", tiff(16, 16, bits=999), INVALID, CORRUPT),
        HostileCase("tiff: strip offset past the end", tiff(64, 64, strip_offset=1 << 30), INVALID, CORRUPT),
        HostileCase("tiff: IFD chain loops to itself", tiff(16, 16, next_ifd=-1), OK, size=(16, 16)),
        # -- compression bombs (valid PNGs of zeros; refused from the header) -------------------
        HostileCase("png bomb: 12000x12000 zeros", png_zeros(12000, 12000, color_type=0), INVALID, TOO_LARGE,
                    bomb=True),
        HostileCase("png bomb: 20000x20000 RGB zeros", png_zeros(20000, 20000, color_type=2), INVALID, TOO_LARGE,
                    bomb=True),
        HostileCase("png: zTXt chunk inflating to 256 MiB", png(8, 8, 0, 8, zlib.compress(bytes(72)), chunks_before=[
                    png_chunk(b"zTXt", b"Comment\x00\x00" + zeros_deflate(256 << 20))]), INVALID, CORRUPT),
        HostileCase("png: iCCP chunk inflating to 64 MiB", png(8, 8, 2, 8, zlib.compress(bytes(8 * 25)), chunks_before=[
                    png_chunk(b"iCCP", b"icc\x00\x00" + zeros_deflate(64 << 20))]), INVALID, CORRUPT),
        # -- animations -------------------------------------------------------------------------
        HostileCase("gif: 3000 frames", gif_frames(3000), OK, size=(1, 1)),
        HostileCase("gif: 12000 frames (frame limit)", gif_frames(12000), INVALID, FRAMES),
        HostileCase("apng: acTL declares 2**31-1 frames", apng_declaring_frames(2**31 - 1), INVALID,
                    FRAMES + "|" + CORRUPT),
        # -- polyglots --------------------------------------------------------------------------
        # GIF89a/*...*/=1;alert(1): the "/*" is the screen width (10799 px), the script follows the trailer.
        _valid("gif/javascript polyglot", b"GIF89a/*" + struct.pack("<HBBB", 10, 0x80, 0, 0) + b"\x00\x00\x00\xff"
               b"\xff\xff\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00\x3b*/=1;alert(1);"),
        _valid("png with a zip appended", small_png + b"PK\x03\x04" + _random_bytes(256, 4)),
        _valid("jpeg with html in a comment", jpeg_segments([(0xFE, b"<script>alert(1)</script>")])),
        HostileCase("html with a png appended", b"<html><body>hi</body></html>" + small_png, INVALID, NOT_IMAGE),
        HostileCase("pdf with a jpeg inside", b"%PDF-1.4\n" + photo + b"\n%%EOF", INVALID, r"PDF"),
        # -- metadata blocks --------------------------------------------------------------------
        _valid("jpeg: 256 APP2 ICC chunks (16 MiB)", jpeg_segments(
            [(0xE2, b"ICC_PROFILE\x00" + bytes([i + 1, 256 if i < 0 else 255]) + _random_bytes(65000, i))
             for i in range(255)])),
        _valid("jpeg: 64 KiB EXIF with 5000 IFD entries", jpeg_segments([(0xE1, b"Exif\x00\x00II*\x00\x08\x00\x00\x00"
               + struct.pack("<H", 5000) + b"".join(struct.pack("<HHII", 0x010E, 2, 1 << 20, 0xFFFFFF00)
                                                    for _ in range(5000))[:65000])])),
        _valid("png: 16 MiB eXIf chunk", png(8, 8, 0, 8, zlib.compress(raw_rows(np.full((8, 8), 9, np.uint8))),
               chunks_before=[png_chunk(b"eXIf", b"MM\x00*\x00\x00\x00\x08" + _random_bytes(16 << 20, 5))])),
        # -- unusual but valid pixel formats -------------------------------------------------
        _valid("png: 16-bit gray", png(40, 30, 0, 16, zlib.compress(raw_rows(gray16)))),
        _valid("png: 16-bit RGB", png(40, 30, 2, 16, zlib.compress(raw_rows(rgb16)))),
        _valid("png: 16-bit RGBA", png(40, 30, 6, 16, zlib.compress(raw_rows(rgba16)))),
        _valid("tiff: 16-bit gray", encode(Image.fromarray(pattern(40, 30, 2).view("<u2").reshape(30, 40)), "TIFF")),
        _valid("tiff: 32-bit float", encode(Image.fromarray(pattern(40, 30).astype(np.float32)[:, :, 0] * 1e30),
                                            "TIFF")),
        _valid("jpeg: CMYK", encode(Image.fromarray(pattern(40, 30, 4), "CMYK"), "JPEG")),
        _valid("tiff: CMYK", encode(Image.fromarray(pattern(40, 30, 4), "CMYK"), "TIFF")),
        _valid("png: 100000x1 strip", png(100000, 1, 0, 8, zlib.compress(raw_rows(pattern(100000, 1, 1))))),
        # -- palette edge cases ------------------------------------------------------------------
        _valid("png: 2-colour palette, indices up to 255", png(40, 30, 3, 8, zlib.compress(raw_rows(
            indices.astype(np.uint8))), chunks_before=[png_chunk(b"PLTE", b"\xff\x00\x00\x00\x00\xff")])),
        _valid("png: tRNS longer than the palette", png(40, 30, 3, 8, zlib.compress(raw_rows(
            (indices % 4).astype(np.uint8))), chunks_before=[png_chunk(b"PLTE", bytes(range(12))),
                                                           png_chunk(b"tRNS", bytes(range(0, 256, 1)))])),
        _valid("png: 1-bit palette with transparency", png(40, 30, 3, 1, zlib.compress(raw_rows(
            np.packbits(indices % 2, axis=1).astype(np.uint8))), chunks_before=[
            png_chunk(b"PLTE", b"\x00\x00\x00\xff\xff\xff"), png_chunk(b"tRNS", b"\x00")])),
        _valid("png: 4-bit palette", png(40, 30, 3, 4, zlib.compress(raw_rows(
            ((indices[:, 0::2] % 16) << 4 | (indices[:, 1::2] % 16)).astype(np.uint8))), chunks_before=[
            png_chunk(b"PLTE", bytes(range(48)))])),
        _valid("gif: no colour table at all", b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0, 0, 0) + b"\x2c"
               + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00\x3b"),
        _valid("png: 1-bit black and white", encode(Image.fromarray(pattern(40, 30, 1) > 127), "PNG")),
    ]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return tuple(cases)
