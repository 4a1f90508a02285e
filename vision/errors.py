"""The errors that image input can raise. Every one is a `ValueError`, so callers that only care
about "bad input" can catch that; the subclasses say which kind of problem it was.

`kind` names the class of failure in the service's one error taxonomy (`service.errors.Kind`):
vision stays free of the service, the service reads the attribute.
"""

from __future__ import annotations


class ImageError(ValueError):
    """The bytes cannot become a model input. The message says why and what to change."""

    kind = "bad_input"


class ImageDecodeError(ImageError):
    """The bytes are not a readable image: unknown or refused format (documents and audio
    included), truncated, or corrupt."""


class ImageTooLargeError(ImageError):
    """The image exceeds a limit (encoded bytes, decoded pixels, one side, or animation frames)."""

    kind = "too_large"


class ImageOptionsError(ImageError):
    """The preprocessing options themselves are invalid (a cap below 1, an unknown resize mode)."""


class UnsupportedMediaError(ImageError):
    """Media the K3 configuration describes but its processor refuses: video. (Bytes that are no
    media the model knows at all, such as a PDF, are an `ImageDecodeError`: bad input, not an
    unimplemented feature.)"""

    kind = "unsupported"
