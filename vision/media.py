"""The media a Kimi-K3 request may carry, and what planning does with each (docs/MODEL.md §4, §7).

A media item travels with its `Modality`; this is the one place that says what each modality
becomes. Images are planned from their header (`plan_image`). Video is what K3's processor
configuration describes (`vision.video`) and its released processor refuses: `check_modality`
refuses it before any byte is read, with the same message wherever the item came from. Serving
video would mean a plan for it here; the faces only map their wire's names onto `Modality`.
"""

from __future__ import annotations

from enum import StrEnum

from .decode import Buffer, Limits
from .options import ImageOptions
from .preprocess import ImagePlan, Preprocessed, plan_image, preprocess_image
from .video import refuse_video


class Modality(StrEnum):
    IMAGE = "image"
    VIDEO = "video"


def check_modality(modality: Modality, where: str = "") -> None:
    """Refuse a modality the model's processor does not take (`UnsupportedMediaError`)."""
    if modality is not Modality.IMAGE:
        refuse_video(where or modality.value)


def plan_media(modality: Modality, data: Buffer, options: ImageOptions, limits: Limits) -> ImagePlan:
    """What an item becomes (sizes, grid, token count, prompt), from its header alone."""
    check_modality(modality)
    return plan_image(data, options, limits)


def preprocess_media(modality: Modality, data: Buffer, options: ImageOptions, limits: Limits) -> Preprocessed:
    """An item's exact model input."""
    check_modality(modality)
    return preprocess_image(data, options, limits)
