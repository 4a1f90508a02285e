"""Image bytes -> exactly Kimi-K3's model input (preprocessing), and the MoonViT-3D tower.

Importing this package is light (Pillow and numpy; no torch): the preprocessing names below are
what the CLI and the service use.
"""

from .decode import Limits
from .errors import ImageDecodeError, ImageError, ImageTooLargeError, UnsupportedMediaError
from .navit import plan_size
from .preprocess import Preprocessed, count_tokens, options_key, preprocess_image

__all__ = [
    "ImageDecodeError",
    "ImageError",
    "ImageTooLargeError",
    "Limits",
    "Preprocessed",
    "UnsupportedMediaError",
    "count_tokens",
    "options_key",
    "plan_size",
    "preprocess_image",
]
