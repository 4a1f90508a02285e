"""The errors that image input can raise. Every one is a `ValueError`, so callers that only care
about "bad input" can catch that; the subclasses say which kind of problem it was."""

from __future__ import annotations


class ImageError(ValueError):
    """The bytes cannot become a model input. The message says why and what to change."""


class ImageDecodeError(ImageError):
    """The bytes are not a readable image: unknown format (documents and audio included), truncated,
    or corrupt."""


class ImageTooLargeError(ImageError):
    """The image exceeds a limit (encoded bytes, decoded pixels, one side, or animation frames)."""


class UnsupportedMediaError(ImageError):
    """Media the K3 configuration describes but its processor refuses: video. (Bytes that are no
    media the model knows at all, such as a PDF, are an `ImageDecodeError`: bad input, not an
    unimplemented feature.)"""
