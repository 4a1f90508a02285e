"""Image bytes -> exactly Kimi-K3's model input (preprocessing), and the MoonViT-3D tower.

Importing this package is light (Pillow, numpy and OpenCV; no torch): the preprocessing names
below are what the CLI and the service use.
"""

from .decode import DEFAULT_LIMITS, Limits
from .errors import ImageDecodeError, ImageError, ImageOptionsError, ImageTooLargeError, UnsupportedMediaError
from .media import Modality, check_modality, plan_media, preprocess_media
from .navit import plan_size
from .options import DEFAULT_OPTIONS, ImageOptions
from .preprocess import ImagePlan, Preprocessed, count_tokens, plan_image, preprocess_image

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_OPTIONS",
    "ImageDecodeError",
    "ImageError",
    "ImageOptions",
    "ImageOptionsError",
    "ImagePlan",
    "ImageTooLargeError",
    "Limits",
    "Modality",
    "Preprocessed",
    "UnsupportedMediaError",
    "check_modality",
    "count_tokens",
    "plan_image",
    "plan_media",
    "preprocess_media",
    "plan_size",
    "preprocess_image",
]
