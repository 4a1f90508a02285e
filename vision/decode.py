"""Untrusted bytes -> a Pillow image, with every limit checked from the header first.

`open_header` reads only the container header (size, mode, frame count, EXIF orientation);
`decode` then decodes the first frame's pixels. Everything Pillow does here runs with its
warnings silenced (they are about the input, and the input's problems become `ImageError`s).
Pillow's own decompression-bomb limit is not what protects the caller: `Limits` is checked
first, from the header, and is stricter by default.

The bytes may be `bytes` or a memoryview (an encoder worker's shared-memory payload), and are
never copied whole here: Pillow reads a `bytes` object through `io.BytesIO`, which shares its
memory, and any other buffer through `_ViewFile`, a read-only file over the view (`io.BytesIO`
would copy it). Pillow itself still reads WebP and AVIF files whole.
"""

from __future__ import annotations

import io
import struct
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from PIL import Image

from .errors import ImageDecodeError, ImageTooLargeError
from .video import refuse_video

# Formats whose decoders Pillow ships and that have unambiguous signatures (JPEG includes MPO). Formats such as EPS
# (runs Ghostscript) or TGA (no signature: random bytes can "be" a TGA) are left out on purpose.
ACCEPTED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "AVIF", "JPEG2000", "PPM", "ICO")

# Formats whose frame count needs a walk over the file (Pillow seeks); done on a separate
# handle so the image that gets decoded is never moved off its first frame.
_FRAME_WALK_FORMATS = ("GIF", "TIFF")


@dataclass(frozen=True)
class Limits:
    """What an input may be at most. Checked before any pixel is decoded."""

    max_bytes: int = 32 * 1024 * 1024  # encoded size
    max_pixels: int = 64_000_000  # decoded width * height of the first frame
    max_side: int = 131_072  # longest decoded side
    max_frames: int = 10_000  # animation frames in the container (only the first is used)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_side", "max_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")

    def check_encoded_size(self, size: int) -> None:
        """Refuse an encoded image of `size` bytes over `max_bytes` (a reader that knows a file's
        size calls this before reading it)."""
        if size > self.max_bytes:
            raise ImageTooLargeError(
                f"encoded image is {size:,} bytes, over the per-image byte limit ({self.max_bytes:,} bytes); "
                "send a smaller or more compressed file"
            )


DEFAULT_LIMITS = Limits()

Buffer = bytes | bytearray | memoryview  # what `open_header` takes


# --- reading without a copy ------------------------------------------------------------------
class _ViewFile(io.BufferedIOBase):
    """A read-only, seekable file over a memoryview: each read copies only what it returns."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("read of a closed file")
        start = self._pos
        end = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        self._pos = max(start, end)
        return bytes(self._view[start:end])

    read1 = read

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self.closed:
            raise ValueError("seek on a closed file")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getvalue(self) -> memoryview:
        """The whole file, uncopied (Pillow's libtiff decoder takes it so instead of `read()`)."""
        return self._view

    def close(self) -> None:
        self._view = memoryview(b"")  # a Pillow image left open must not pin the caller's memory
        super().close()


def _file(data: bytes | memoryview) -> IO[bytes]:
    return io.BytesIO(data) if isinstance(data, bytes) else _ViewFile(data)


# --- warnings --------------------------------------------------------------------------------
# `warnings.catch_warnings` swaps the process-wide filter list, so two threads using it at once
# can restore each other's state. Concurrent decodes share one swap, counted under a lock, and
# the filter only matches warnings attributed to Pillow's or this package's modules.
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_cm: warnings.catch_warnings | None = None


@contextmanager
def pillow_quiet() -> Iterator[None]:
    global _quiet_depth, _quiet_cm
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_cm = warnings.catch_warnings()
            _quiet_cm.__enter__()
            warnings.filterwarnings("ignore", module=r"(PIL|vision)(\.|$)")
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _quiet_cm is not None:
                _quiet_cm.__exit__(None, None, None)
                _quiet_cm = None


# --- what the bytes are ----------------------------------------------------------------------
_ISO_BMFF_IMAGE_BRANDS = {b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}


def sniff_non_image(data: bytes | memoryview) -> str | None:
    """A short description if `data` is recognisably video, audio or a document, else None."""
    head = bytes(data[:64])
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _ISO_BMFF_IMAGE_BRANDS:
            return None
        return f"an MP4/QuickTime video (brand {brand.decode('latin-1').strip()!r})"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "a Matroska/WebM video"
    if head.startswith(b"RIFF") and head[8:12] in (b"AVI ", b"WAVE"):
        return "an AVI video" if head[8:12] == b"AVI " else "a WAV audio file"
    if head.startswith(b"FLV\x01"):
        return "an FLV video"
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return "an ASF/WMV video"
    if head.startswith((b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3")):
        return "an MPEG video"
    if len(data) > 188 and data[0] == 0x47 and data[188] == 0x47:
        return "an MPEG transport stream (video)"
    if head.startswith(b"OggS"):
        return "an Ogg media file"
    if head.startswith((b"ID3", b"fLaC")):
        return "an audio file"
    if head.startswith(b"%PDF"):
        return "a PDF document"
    return None


# --- header ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """What the container header says, before any pixel is decoded."""

    format: str
    mode: str
    size: tuple[int, int]  # decoded (width, height) of the first frame
    frames: int
    orientation: int  # EXIF orientation 1..8 (1 when absent or not asked for)


_SIGNATURES = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF8", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"BM", "BMP"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG2000"),
    (b"\xffO\xffQ", "JPEG2000"),
)


def _signature(data: bytes | memoryview) -> str | None:
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _SIGNATURES if head.startswith(magic)), None)


def accepted_formats() -> list[str]:
    """The accepted formats this Pillow build can open (builds without an optional codec, such as
    AVIF before Pillow 11.3, simply do not offer it)."""
    Image.init()  # registers every plugin (once); `formats=` only knows registered ones
    return [name for name in ACCEPTED_FORMATS if name in Image.OPEN]


def _refused_format(data: bytes | memoryview) -> str | None:
    """The name of the format Pillow reads `data` as, among those it knows but we refuse."""
    refused = [name for name in Image.OPEN if name not in ACCEPTED_FORMATS]
    try:
        with Image.open(_file(data), formats=refused) as image:  # the header only, never decoded
            return image.format
    except Exception:  # noqa: BLE001 - not one of them either (or too broken to tell)
        return None


def _open(data: bytes | memoryview, limits: Limits) -> Image.Image:
    formats = accepted_formats()
    try:
        return Image.open(_file(data), formats=formats)
    except Image.DecompressionBombError:
        # Pillow's own ceiling (2 x Image.MAX_IMAGE_PIXELS) trips before our check can run.
        raise ImageTooLargeError(
            f"image header declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels, over the "
            f"{limits.max_pixels:,}-pixel limit; downscale it before sending"
        ) from None
    except Image.UnidentifiedImageError:
        kind = _signature(data)
        if kind is not None:
            raise ImageDecodeError(f"truncated or corrupt {kind} header") from None
        accepted = ", ".join(formats)
        refused = _refused_format(data)
        if refused is not None:
            raise ImageDecodeError(f"{refused} images are not accepted (accepted formats: {accepted})") from None
        raise ImageDecodeError(f"not a recognised image (accepted formats: {accepted})") from None
    except Exception as e:  # Pillow raises many types on malformed headers
        raise ImageDecodeError(f"truncated or corrupt image header: {_describe(e)}") from None


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _frame_count(image: Image.Image, data: bytes | memoryview) -> int:
    if image.format in _FRAME_WALK_FORMATS:
        probe = Image.open(_file(data), formats=(image.format,))
        try:
            return int(getattr(probe, "n_frames", 1))
        finally:
            probe.close()
    return int(getattr(image, "n_frames", 1))


def _png_exif_after_pixels(data: bytes | memoryview) -> bytes | None:
    """The eXIf chunk of a PNG when it follows the image data (Pillow finds it only on load)."""
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf":
            return b"Exif\x00\x00" + bytes(data[pos + 8 : pos + 8 + length])
        if kind == b"IEND":
            return None
        pos += 12 + length
    return None


def _orientation(image: Image.Image, data: bytes | memoryview) -> int:
    if image.format == "PNG" and "exif" not in image.info:
        exif = _png_exif_after_pixels(data)
        if exif is not None:
            image.info["exif"] = exif
    # The base-class getexif reads what the header gave (PNG's override would decode pixels).
    value = Image.Image.getexif(image).get(0x0112, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def open_header(data: Buffer, limits: Limits, *, exif_transpose: bool = False) -> tuple[Image.Image, Header]:
    """Open `data` lazily and check `limits` from the header. No pixel data is decoded, and `data`
    is not copied: the image reads it in place until it is closed (a buffer's contents must not
    change meanwhile)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    if not isinstance(data, bytes):
        data = memoryview(data).cast("B").toreadonly()  # one flat byte per item, whatever the buffer's format
    limits.check_encoded_size(len(data))
    if not data:
        raise ImageDecodeError("image data is empty")
    media = sniff_non_image(data)
    if media is not None:
        if "video" in media:
            refuse_video(f"input looks like {media}")
        raise ImageDecodeError(
            f"input looks like {media}, not an image; Kimi-K3's processor takes still images only "
            "(it rejects every other media type): send an image file"
        )
    with pillow_quiet():
        image = _open(data, limits)
        try:
            w, h = image.size
            if w < 1 or h < 1:
                raise ImageDecodeError(f"image header declares an empty size {w}x{h}")
            if max(w, h) > limits.max_side:
                raise ImageTooLargeError(
                    f"image is {w}x{h}; its longest side is over the {limits.max_side:,}-pixel limit"
                )
            if w * h > limits.max_pixels:
                raise ImageTooLargeError(
                    f"image is {w}x{h} = {w * h:,} pixels, over the {limits.max_pixels:,}-pixel limit; "
                    "downscale it before sending"
                )
            try:
                frames = _frame_count(image, data)
                orientation = _orientation(image, data) if exif_transpose else 1
            except Exception as e:
                raise ImageDecodeError(f"corrupt image container: {_describe(e)}") from None
            if frames > limits.max_frames:
                raise ImageTooLargeError(
                    f"animation has {frames:,} frames, over the {limits.max_frames:,}-frame limit "
                    "(only the first frame is used; send it as a still image)"
                )
        except BaseException:
            image.close()
            raise
    return image, Header(image.format or "?", image.mode, (w, h), frames, orientation)


# Pillow's transpose for each EXIF orientation (the TIFF/EXIF definition of the tag).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def oriented_size(header: Header) -> tuple[int, int]:
    """The size after applying the EXIF orientation (orientations 5-8 swap the sides)."""
    w, h = header.size
    return (h, w) if header.orientation >= 5 else (w, h)


def decode(image: Image.Image, header: Header) -> Image.Image:
    """Decode the first frame's pixels (in its native mode) and apply the EXIF orientation."""
    with pillow_quiet():
        try:
            image.load()
        except Image.DecompressionBombError as e:
            raise ImageTooLargeError(f"image is far too large to decode ({e})") from None
        except MemoryError:
            raise ImageTooLargeError("not enough memory to decode this image") from None
        except Exception as e:  # truncated or corrupt pixel data: OSError, SyntaxError, zlib.error, ...
            raise ImageDecodeError(f"image data is truncated or corrupt: {_describe(e)}") from None
        if image.size != header.size:
            raise ImageDecodeError(f"decoded size {image.size} differs from the header's {header.size}")
        method = _TRANSPOSE.get(header.orientation)
        return image.transpose(method) if method is not None else image
