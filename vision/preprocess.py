"""Image bytes -> exactly the model input Kimi-K3's own processor produces (docs/MODEL.md §4).

The reference steps, and how this module does each one:
  1. size rule                  -> `vision.navit.plan_size` (same float expressions), read from the
                                   header alone by `plan_image`
  2. Pillow BICUBIC resize in the image's native mode -> Pillow itself (it *is* the reference)
  3. checkerboard compositing after the resize (float32 blend, truncation)
                                -> one gather from a 2x256x256 table built with the same float32 ops
  4. black bottom/right padding -> one copy from Pillow's own pixel memory (no `tobytes`), a band
                                   of rows at a time, into a canvas whose padding is zeroed
  5. normalisation `(x/255.0).astype(float32) - 0.5) * 2.0` -> a 256-entry table built by those ops
  6. row-major 14x14 patches    -> a band of patch rows at a time: channels split, 14-pixel runs
                                   copied into patch order, then one table lookup into the output
                                   (built lazily, on first use)
Steps 3 and 5 are exact because their inputs are uint8: a table over every possible input holds
exactly what the float expression gives. `resize="fast"` swaps step 2 for OpenCV (not exact).

`preprocess_image` gives the padded uint8 image (and the patches on demand); `preprocess_patches`
gives only the patches, built band by band straight from Pillow's pixels, never writing the padded
image: what an encoder worker that builds the patches on the host needs. `vision.patchify` builds
the same patches from the uint8 image on a torch device instead.

Each call opens the header once (`vision.decode.open_header`), and the pixels are decoded from
that same open image. A caller that already holds the image's plan (an encoder worker is sent the
one its parent made with `plan_image`) passes it as `plan=`, having sized its buffers by it: the
header is then checked to agree with it (a plan for other bytes or options is a `ValueError`, the
caller's bug, never a result for the wrong plan), and the header is not read a second time.

Both large outputs can be written into a buffer the caller owns and reuses (`out=`): the padded
uint8 image (36 MB for 12 MP) and the float32 patches (145 MB). A fresh buffer of that size is a
fresh mapping whose pages the kernel zero-fills on first touch (measured for the 12 MP patches:
77.5 ms into a fresh buffer, 49 ms into a touched one), so a worker that preprocesses image after
image keeps its buffers (`vision.buffers.BufferPool`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import cv2
import numpy as np
from PIL import Image

from .decode import DEFAULT_LIMITS, Buffer, Header, Limits, decode, open_header, oriented_size, pillow_quiet
from .errors import ImageDecodeError
from .navit import IN_PATCH_LIMIT, MERGE_KERNEL_SIZE, PATCH_LIMIT_ON_ONE_SIDE, PATCH_SIZE, SizePlan, plan_size
from .options import DEFAULT_OPTIONS, ImageOptions
from .video import VideoConfig

# Processor config (docs/MODEL.md §3).
IMAGE_MEAN = 0.5  # the same for all three channels
IMAGE_STD = 0.5
CHECKER_SQUARE = 8
CHECKER_WHITE = 255  # the top-left square
CHECKER_GRAY = 180

PROMPT_TEMPLATE = "<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"
PATCH_VALUES = 3 * PATCH_SIZE * PATCH_SIZE  # float32 values per patch in pixel_values


def _normalise_table() -> np.ndarray:
    # The reference expression applied to every possible uint8 value: float64 division, cast to
    # float32, then float64 mean and 1/std (numpy promotes), cast back to float32.
    x = (np.arange(256, dtype=np.uint8) / 255.0).astype(np.float32)
    x = x - np.array([IMAGE_MEAN], dtype=np.float64)
    x = x * (1.0 / np.array([IMAGE_STD], dtype=np.float64))
    return x.astype(np.float32)


def _composite_table() -> np.ndarray:
    # table[g, a, v] = the reference blend of colour value v with alpha a over background g
    # (0 = white, 1 = gray): float32 alpha = a / 255, alpha*v + (1-alpha)*bg, truncated to uint8.
    alpha = (np.arange(256, dtype=np.uint8).astype(np.float32) / 255.0)[None, :, None]
    value = np.arange(256, dtype=np.uint8)[None, None, :]
    background = np.array([CHECKER_WHITE, CHECKER_GRAY], dtype=np.uint8)[:, None, None]
    return (alpha * value + (1.0 - alpha) * background).astype(np.uint8)


NORMALISE_TABLE = _normalise_table()
NORMALISE_TABLE.flags.writeable = False
COMPOSITE_TABLE = _composite_table()
COMPOSITE_TABLE.flags.writeable = False
_COMPOSITE_FLAT = COMPOSITE_TABLE.reshape(-1)


def processor_config() -> dict[str, Any]:
    """The release's `preprocessor_config.json` `media_proc_cfg`, from the constants this package runs."""
    video = VideoConfig()
    return {
        "in_patch_limit": IN_PATCH_LIMIT,
        "patch_size": PATCH_SIZE,
        "merge_kernel_size": MERGE_KERNEL_SIZE,
        "patch_limit_on_one_side": PATCH_LIMIT_ON_ONE_SIDE,
        "image_mean": [IMAGE_MEAN] * 3,
        "image_std": [IMAGE_STD] * 3,
        "in_patch_limit_each_frame": video.patches_per_frame,
        "sample_fps": video.sample_fps,
        "temporal_merge_kernel_size": video.frames_per_chunk,
        "transparent_bg_config": {
            "pattern": "chessboard",
            "chessboard_square_size": CHECKER_SQUARE,
            "chessboard_square_on_top_left": True,
            "chessboard_white_value": CHECKER_WHITE,
            "chessboard_gray_value": CHECKER_GRAY,
        },
        "transparent_bg_fill_stage": "after_resize",
    }


@dataclass(frozen=True)
class ImagePlan(SizePlan):
    """What an image becomes, known from its header alone (sizes are (width, height))."""

    source_format: str  # the container format Pillow read ("JPEG", "PNG", ...)
    source_mode: str  # its native Pillow mode ("RGB", "P", "LA", ...)

    @property
    def image_bytes(self) -> int:
        """Bytes of the padded uint8 model input (H x W x 3): what `preprocess_image(out=)` needs."""
        w, h = self.padded_size
        return h * w * 3

    @property
    def pixel_values_size(self) -> int:
        """float32 values in `pixel_values`: what `patchify_normalise(out=)` needs."""
        return self.num_patches * PATCH_VALUES

    @property
    def prompt(self) -> str:
        """The image's prompt text, with its decoded (pre-resize) size."""
        w, h = self.orig_size
        return PROMPT_TEMPLATE.format(w=w, h=h)


@dataclass(frozen=True, eq=False)
class Preprocessed(ImagePlan):
    """One image as the model takes it: its plan and the padded pixels."""

    image: np.ndarray = field(repr=False)  # uint8 (H, W, 3) padded model input, C-contiguous, read-only
    _pixel_values: np.ndarray | None = field(default=None, repr=False)

    @property
    def pixel_values(self) -> np.ndarray:
        """float32 [N, 3, 14, 14], N = rows * columns, patches in raster order. Built on first use."""
        if self._pixel_values is None:
            object.__setattr__(self, "_pixel_values", patchify_normalise(self.image))
        return self._pixel_values


# Patch rows are built a band at a time so the band's uint8 planes and patches stay in the CPU
# cache between the steps; about 256 KiB of input pixels per band (one patch row of a 4000-px-wide
# image).
_BAND_BYTES = 256 * 1024
# One channel's 14 pixels of one patch row, moved as a single 14-byte item: the re-layout then
# copies 2.6 M items for a 12 MP image instead of 36 M single bytes.
_PATCH_ROW = np.dtype((np.void, PATCH_SIZE))
# fill(top, bottom, planes): the padded image's pixel rows top..bottom-1, channel-planar, into
# planes[c, :bottom - top] (planes 0-2 are R, G, B; plane 3 takes the padding byte of 4-byte pixels).
BandFill = Callable[[int, int, np.ndarray], None]


def patchify_normalise(image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 (H, W, 3) with H, W multiples of 14 -> normalised float32 [H/14 * W/14, 3, 14, 14].

    `out`: a writable, C-contiguous float32 buffer of at least that many values, which the result
    is a view of (its first values); None allocates a new array."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 (H, W, 3) image, got {image.dtype} {list(image.shape)}")
    h, w, _ = image.shape
    if h % PATCH_SIZE or w % PATCH_SIZE:
        raise ValueError(f"image {h}x{w} is not a multiple of the {PATCH_SIZE}-px patch")
    return _build_patches((w, h), out, lambda top, bottom, planes: _split_into(image[top:bottom], planes))


def _build_patches(padded_size: tuple[int, int], out: np.ndarray | None, fill: BandFill) -> np.ndarray:
    """Normalised float32 patches [N, 3, 14, 14] of the padded image `fill` writes, in `out`."""
    pw, ph = padded_size
    rows, cols, p = ph // PATCH_SIZE, pw // PATCH_SIZE, PATCH_SIZE
    out = _output_view(out, np.float32, (rows, cols, 3, p, p))
    band = max(1, _BAND_BYTES // (p * pw * 3))
    planes = np.zeros((4, band * p, pw), dtype=np.uint8)  # one band, channel-planar
    patches = np.empty((band, cols, 3, p, p), dtype=np.uint8)  # the same band in patch order
    for top in range(0, rows, band):
        n = min(rows, top + band) - top
        # Three passes over the cache-resident band, each at memory speed: the channels split
        # (`fill`), the 14-pixel runs re-laid into patch order, then one table lookup straight
        # into the output (contiguous). Measured on one core for a 4004x3024 image, 15 interleaved
        # runs: 35 ms (min), against 44 ms for looking the table up on the interleaved pixels and
        # re-laying the floats out.
        fill(top * p, (top + n) * p, planes)
        runs = planes[:3, : n * p].reshape(3, n, p, pw).view(_PATCH_ROW)  # (3, n, p, cols)
        patches[:n].view(_PATCH_ROW)[..., 0] = runs.transpose(1, 3, 0, 2)
        target = out[top : top + n].reshape(-1, p)
        _written_into(target, cv2.LUT(patches[:n].reshape(-1, p), NORMALISE_TABLE, dst=target))
    return out.reshape(rows * cols, 3, p, p)


def _split_into(pixels: np.ndarray, planes: np.ndarray) -> None:
    """Interleaved uint8 (rows, w, c) -> planes[:c, :rows, :w]."""
    rows, w, c = pixels.shape
    given = [planes[i, :rows, :w] for i in range(c)]
    for target, got in zip(given, cv2.split(pixels, given), strict=True):
        _written_into(target, got)


def _output_view(buffer: np.ndarray | None, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) items of a caller's buffer viewed as `shape`, or a new array."""
    if buffer is None:
        return np.empty(shape, dtype=dtype)
    size = int(np.prod(shape))
    if buffer.dtype != dtype or not buffer.flags.c_contiguous or not buffer.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {np.dtype(dtype)} buffer, got {buffer.dtype} "
                         f"(contiguous {buffer.flags.c_contiguous}, writable {buffer.flags.writeable})")
    if buffer.size < size:
        raise ValueError(f"out holds {buffer.size} values; this image needs {size}")
    return buffer.reshape(-1)[:size].reshape(shape)


def _written_into(target: np.ndarray, result: np.ndarray) -> None:
    # OpenCV returns `dst` itself when it wrote into it, and a new array when it could not use it;
    # the second would leave uninitialised memory in the output, so it is an error, never silent.
    if result is not target:
        raise RuntimeError("OpenCV did not write into the output array it was given")


def _checker_index(top: int, bottom: int, width: int) -> np.ndarray:
    # 0 where the square is white, 1 where gray, for rows top..bottom-1; built per call, never
    # cached (an image-sized background held in a cache is the reference's memory pitfall).
    ys = (np.arange(top, bottom) // CHECKER_SQUARE % 2).astype(np.uint8)
    xs = (np.arange(width) // CHECKER_SQUARE % 2).astype(np.uint8)
    return ys[:, None] ^ xs[None, :]


def _needs_composite(image: Image.Image) -> bool:
    # The reference's rule, in its order: RGB is returned as is (even with a tRNS colour);
    # otherwise an alpha band (any band named "A") or a transparency entry means compositing.
    if image.mode == "RGB":
        return False
    return "A" in image.getbands() or "transparency" in image.info


def _padded_canvas(height: int, width: int, padded_size: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
    """An uninitialised (Hp, Wp, 3) uint8 canvas (in `out` if given) whose bottom/right padding is
    already black."""
    pw, ph = padded_size
    canvas = _output_view(out, np.uint8, (ph, pw, 3))
    canvas[height:] = 0
    canvas[:height, width:] = 0
    return canvas


# --- Pillow's pixels without tobytes ---------------------------------------------------------
# Pillow holds RGB and RGBA images as 4 bytes per pixel. `np.asarray(image)` goes through
# `tobytes()`, which packs every pixel to 3 bytes into a new bytes object: for a 12 MP photo that
# costs most of what the JPEG decode itself costs. Pillow's Arrow export (recent releases) hands
# out the image's own memory instead, but only for an image held in one block, and Pillow's
# allocator splits images over 16 MiB into several. Such an image is read a band of rows at a
# time: each band is cropped (a row-by-row memcpy into a small image that stays in the CPU cache)
# and exported. Pillow's process-wide allocator settings are left alone on purpose: its
# single-block allocator would make every large decode one fresh allocation that the OS has to
# page in (measured: about 12,000 page faults, ~50 ms, per 12 MP decode once the process is warm),
# which costs more than the crops, and it would change every other Pillow user in the process.
_ROW_BAND_BYTES = 1024 * 1024


class _ArrowArray(ctypes.Structure):
    """`struct ArrowArray` of the Arrow C data interface (a stable ABI)."""


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


class _ExportedPixels:
    """What numpy wraps: the address of Pillow's pixels, plus the Arrow capsule, which holds a
    reference on the image memory for as long as any array made from this object lives."""

    def __init__(self, capsule: object, address: int, shape: tuple[int, int, int]) -> None:
        self.capsule = capsule
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": "|u1", "data": (address, True)}


def _pixels_view(image: Image.Image) -> np.ndarray | None:
    """A read-only uint8 (H, W, 4) view of an RGB or RGBA image's own memory (for RGB the fourth
    byte is Pillow's padding), or None where Pillow cannot export it (several blocks, older Pillow)."""
    w, h = image.size
    try:
        _schema, capsule = image.__arrow_c_array__()
    except (AttributeError, ValueError):
        return None
    array = _ArrowArray.from_address(_capsule_pointer(capsule, b"arrow_array"))
    # Pillow exports 4-band images as one fixed-size list of 4 uint8 per pixel: a child array
    # whose second buffer holds all the bytes, row after row.
    if array.n_children != 1 or array.length != w * h or array.offset != 0:
        return None
    child = array.children[0].contents
    if child.n_buffers != 2 or child.length != 4 * w * h or child.offset != 0 or not child.buffers[1]:
        return None
    return np.asarray(_ExportedPixels(capsule, child.buffers[1], (h, w, 4)))


class _PixelRows:
    """Rows of an RGB or RGBA Pillow image as uint8 arrays, asked for top to bottom: (rows, W, 4)
    views of Pillow's memory (for RGB the fourth byte is Pillow's padding), or (rows, W, 3 or 4)
    copies through `tobytes` where Pillow cannot export (an older Pillow). An image Pillow holds in
    several blocks is cropped a band of about 1 MiB at a time, and asked-for rows are sliced from
    the band."""

    def __init__(self, image: Image.Image) -> None:
        self.image = image
        self.width, self.height = image.size
        self.band_top, self.band = 0, _pixels_view(image)  # the whole image when Pillow exports it

    def __call__(self, top: int, bottom: int) -> np.ndarray:
        band = self.band
        if band is None or top < self.band_top or bottom > self.band_top + band.shape[0]:
            end = min(self.height, max(bottom, top + _ROW_BAND_BYTES // (4 * self.width)))
            crop = self.image.crop((0, top, self.width, end))
            view = _pixels_view(crop)
            band = view if view is not None else np.asarray(crop)
            self.band_top, self.band = top, band
        return band[top - self.band_top : bottom - self.band_top]


def _composited(pixels: np.ndarray, top: int) -> np.ndarray:
    """RGBA rows from image row `top` -> the reference's checkerboard composite, uint8 RGB: one
    gather per value from the flattened [background, alpha, value] table."""
    bottom, w = top + pixels.shape[0], pixels.shape[1]
    key = (_checker_index(top, bottom, w).astype(np.uint32) << 16) | (pixels[:, :, 3].astype(np.uint32) << 8)
    return _COMPOSITE_FLAT[key[:, :, None] + pixels[:, :, :3]]


def _rgb_source(image: Image.Image) -> tuple[Image.Image, bool]:
    """The resized image as Pillow RGBA (to be composited) or RGB, and which of the two."""
    composite = _needs_composite(image)
    mode = "RGBA" if composite else "RGB"
    if image.mode == mode:
        return image, composite
    try:
        with pillow_quiet():
            return image.convert(mode), composite
    except (ValueError, OSError) as e:  # a mode Pillow cannot convert
        raise ImageDecodeError(f"cannot convert a {image.mode!r} image to RGB: {e}") from None


def _to_padded_rgb(image: Image.Image, padded_size: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
    """Resized image -> uint8 (Hp, Wp, 3) (in `out` if given): compositing or RGB conversion, then
    black padding."""
    source, composite = _rgb_source(image)
    w, h = source.size
    canvas = _padded_canvas(h, w, padded_size, out)
    rows = _PixelRows(source)
    step = max(1, _ROW_BAND_BYTES // (4 * w))
    for top in range(0, h, step):
        pixels = rows(top, min(h, top + step))
        target = canvas[top : top + pixels.shape[0], :w]
        if composite:
            target[...] = _composited(pixels, top)
        elif pixels.shape[2] == 4:
            # Drop Pillow's padding byte while copying into the canvas (numpy's strided copy of 3
            # of every 4 bytes is several times slower than OpenCV's).
            _written_into(target, cv2.cvtColor(pixels, cv2.COLOR_RGBA2RGB, dst=target))
        else:
            target[...] = pixels
    canvas.flags.writeable = False
    return canvas


def _patches_of(image: Image.Image, padded_size: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
    """Resized image -> normalised float32 patches of its padded RGB image, built a band at a time
    straight from Pillow's pixels: the padded uint8 image is never written (one pass over 36 MB
    fewer for 12 MP), and 4-byte pixels are split into planes as they are (the padding byte goes
    to a fourth plane)."""
    source, composite = _rgb_source(image)
    w, h = source.size
    rows = _PixelRows(source)

    def fill(top: int, bottom: int, planes: np.ndarray) -> None:
        real = max(0, min(h, bottom) - top)
        if real:
            pixels = rows(top, top + real)
            _split_into(_composited(pixels, top) if composite else pixels, planes)
        planes[:, real : bottom - top] = 0  # below the image: black padding (columns past w stay 0)

    return _build_patches(padded_size, out, fill)


def _resize_exact(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    if image.size == size:
        return image  # Pillow's resize to the same size is a plain copy
    with pillow_quiet():
        return image.resize(size, resample=Image.Resampling.BICUBIC)


# Modes whose reference resize is a bicubic filter over 8-bit samples: the fast path applies to
# these. P and 1 already resize with NEAREST (cheap); other modes take the exact path.
_FAST_MODES = {"RGB": None, "L": None, "RGBA": "RGBa", "LA": "La"}


def _resize_fast(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    if image.size == size or image.mode not in _FAST_MODES:
        return _resize_exact(image, size)
    premultiplied = _FAST_MODES[image.mode]
    with pillow_quiet():
        # Pillow resizes alpha images premultiplied; so does this, or transparent pixels' colours
        # would bleed into their neighbours.
        source = image.convert(premultiplied) if premultiplied else image
        array = np.asarray(source)
        resized = cv2.resize(array, size, interpolation=cv2.INTER_AREA)
        if resized.ndim == 2 and array.ndim == 3:  # OpenCV drops a trailing channel axis of 1
            resized = resized[:, :, None]
        out = Image.fromarray(resized, mode=premultiplied or image.mode)
        out = out.convert(image.mode) if premultiplied else out
    out.info = dict(image.info)
    return out


def _plan(header: Header, options: ImageOptions) -> ImagePlan:
    size = plan_size(*oriented_size(header), options.max_tokens)
    return ImagePlan(size.orig_size, size.size, size.padded_size, header.format, header.mode)


def plan_image(data: Buffer, options: ImageOptions = DEFAULT_OPTIONS, limits: Limits = DEFAULT_LIMITS) -> ImagePlan:
    """Sizes, grid, token count and prompt `preprocess_image` gives for the same bytes and options,
    from the header alone (no pixel decode). Raises the same `ImageError`s for limits and
    unreadable headers."""
    image, header = open_header(data, limits, exif_transpose=options.exif_transpose)
    image.close()
    return _plan(header, options)


def count_tokens(data: Buffer, options: ImageOptions = DEFAULT_OPTIONS, limits: Limits = DEFAULT_LIMITS) -> int:
    """The token count of `plan_image`."""
    return plan_image(data, options, limits).num_tokens


def preprocess_image(data: Buffer, options: ImageOptions = DEFAULT_OPTIONS, limits: Limits = DEFAULT_LIMITS, *,
                     out: np.ndarray | None = None, plan: ImagePlan | None = None) -> Preprocessed:
    """Encoded image bytes -> the model input. The default options reproduce the reference bit for
    bit. `limits` are checked from the header, before any pixel is decoded (`ImageTooLargeError`).
    Raises `ImageError` subclasses for bad input.

    `out`: a writable, C-contiguous uint8 buffer of at least `plan_image(...).image_bytes` bytes;
    the padded image is built in it and the result's `image` is a read-only view of it, valid
    until the caller writes the buffer again. None allocates a new array.
    `plan`: the caller's `plan_image(data, options)`, checked against the header (`ValueError` if
    it is another image's)."""
    with _opened(data, options, limits, plan) as (image, header, plan):
        if out is not None:  # checked before the decode, and never reported as an image error
            pw, ph = plan.padded_size
            out = _output_view(out, np.uint8, (ph, pw, 3))
        padded = _to_padded_rgb(_resized(image, header, plan, options), plan.padded_size, out)
    return Preprocessed(plan.orig_size, plan.size, plan.padded_size, plan.source_format, plan.source_mode,
                        image=padded)


def preprocess_patches(data: Buffer, options: ImageOptions = DEFAULT_OPTIONS, limits: Limits = DEFAULT_LIMITS, *,
                       out: np.ndarray | None = None, plan: ImagePlan | None = None) -> tuple[ImagePlan, np.ndarray]:
    """Encoded image bytes -> (plan, pixel_values): bit for bit `preprocess_image`'s plan and
    `.pixel_values`, built without the padded uint8 image (what a worker that builds the patches on
    the host runs). Raises what `preprocess_image` raises.

    `out`: a writable, C-contiguous float32 buffer of at least `plan_image(...).pixel_values_size`
    values, which the patches are a view of; None allocates a new array.
    `plan`: as for `preprocess_image`."""
    with _opened(data, options, limits, plan) as (image, header, plan):
        if out is not None:  # checked before the decode, and never reported as an image error
            out = _output_view(out, np.float32, (plan.pixel_values_size,))
        pixel_values = _patches_of(_resized(image, header, plan, options), plan.padded_size, out)
    return plan, pixel_values


@contextmanager
def _opened(data: Buffer, options: ImageOptions, limits: Limits,
            given: ImagePlan | None) -> Iterator[tuple[Image.Image, Header, ImagePlan]]:
    """The image opened from its header (limits checked, nothing decoded) and its plan; closed
    after. A `given` plan must be the one the header and options make (the size rule is
    arithmetic: checking costs no second header read)."""
    image, header = open_header(data, limits, exif_transpose=options.exif_transpose)
    try:
        plan = _plan(header, options)
        if given is not None and _plan_fields(given) != _plan_fields(plan):
            raise ValueError(f"the caller's plan {_plan_fields(given)} is not this image's: its header and options "
                             f"give {_plan_fields(plan)} (orig_size, size, padded_size, source_format, source_mode)")
        yield image, header, plan
    finally:
        image.close()


def _plan_fields(plan: ImagePlan) -> tuple[Any, ...]:
    # An ImagePlan's own fields, so a Preprocessed (a plan with pixels) compares as its plan.
    return tuple(getattr(plan, f.name) for f in fields(ImagePlan))


def _resized(image: Image.Image, header: Header, plan: ImagePlan, options: ImageOptions) -> Image.Image:
    decoded = decode(image, header)
    if decoded.size != plan.orig_size:
        raise ImageDecodeError(f"decoded size {decoded.size} differs from the header's {plan.orig_size}")
    return (_resize_fast if options.resize == "fast" else _resize_exact)(decoded, plan.size)

