"""The preprocessing options: everything a caller may change about how bytes become model input.

One frozen value, checked when it is made, and named by `key()`: the canonical string every
cache key and export name is built from. The key carries the preprocessing version, so a change
of output for the same options changes every key. Limits (`vision.decode.Limits`) are not
options: they only accept or refuse an input, never change what it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import ImageOptionsError

PREPROCESSING_VERSION = "kimi-k3-image/v1"  # bump when the output for the same options changes
ResizeMode = Literal["exact", "fast"]
RESIZE_MODES = ("exact", "fast")


@dataclass(frozen=True)
class ImageOptions:
    # Strict cap on the image's token count; None = the reference's own budget (<= 16,817).
    max_tokens: int | None = None
    # Apply the EXIF orientation first (the reference does not).
    exif_transpose: bool = False
    # "exact": Pillow BICUBIC, the reference. "fast": OpenCV INTER_AREA for 8-bit RGB/L/RGBA/LA
    # images (close to, not identical with, the reference).
    resize: ResizeMode = "exact"

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_MODES:
            raise ImageOptionsError(f"resize must be one of {RESIZE_MODES}, got {self.resize!r}")
        cap = self.max_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ImageOptionsError(f"max_tokens must be a positive integer or None, got {cap!r}")
        if not isinstance(self.exif_transpose, bool):
            raise ImageOptionsError(f"exif_transpose must be a bool, got {self.exif_transpose!r}")

    def key(self) -> str:
        """A stable string naming every option that changes the output."""
        return (f"{PREPROCESSING_VERSION};max_tokens={self.max_tokens};exif_transpose={int(self.exif_transpose)};"
                f"resize={self.resize}")


DEFAULT_OPTIONS = ImageOptions()
