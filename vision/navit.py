"""Kimi-K3's NaViT size rule: original size -> resized size, padded size, patch grid, token count.

Pure integer/float arithmetic, no pixels, so the header-only token count and the full
preprocessing path share it. The float expressions follow the reference processor literally
(docs/MODEL.md §4, step 1): changing their order changes results (100000x1 -> 7167x1, not 7168x1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PATCH_SIZE = 14
MERGE_KERNEL_SIZE = 2
IN_PATCH_LIMIT = 65536
PATCH_LIMIT_ON_ONE_SIDE = 512
# One token covers a 2x2 block of 14-px patches; padded sides are multiples of this.
TOKEN_SIDE = PATCH_SIZE * MERGE_KERNEL_SIZE  # 28
MAX_SIDE = PATCH_LIMIT_ON_ONE_SIDE * PATCH_SIZE  # 7168
# The 65,536-patch budget applies before padding, so padding can push the count past 16,384.
MAX_REFERENCE_TOKENS = 16817


@dataclass(frozen=True)
class SizePlan:
    """Where an image of `orig_size` ends up. All sizes are (width, height)."""

    orig_size: tuple[int, int]
    size: tuple[int, int]  # after resize, before padding
    padded_size: tuple[int, int]  # multiples of 28, black bottom/right

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(frames, patch rows, patch columns) of the padded image in 14-px patches."""
        w, h = self.padded_size
        return (1, h // PATCH_SIZE, w // PATCH_SIZE)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        w, h = self.padded_size
        return (h // TOKEN_SIDE) * (w // TOKEN_SIDE)


def _resized(width: int, height: int, in_patch_limit: int | float) -> tuple[int, int]:
    # Same expressions, same order as the reference: integer division inside, Python floats,
    # truncation by int(), clamp to the one-side limit last.
    s1 = math.sqrt(in_patch_limit / (max(1, width // PATCH_SIZE) * max(1, height // PATCH_SIZE)))
    s2 = MAX_SIDE / width
    s3 = MAX_SIDE / height
    scale = min(1, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), MAX_SIDE)
    new_h = min(max(1, int(height * scale)), MAX_SIDE)
    return new_w, new_h


def _padded(width: int, height: int) -> tuple[int, int]:
    return (-(-width // TOKEN_SIDE) * TOKEN_SIDE, -(-height // TOKEN_SIDE) * TOKEN_SIDE)


def plan_size(width: int, height: int, max_tokens: int | None = None) -> SizePlan:
    """The reference size rule for a `width` x `height` image.

    `max_tokens` is an optional strict cap on the padded token count. When the reference rule
    already fits under it the result is the reference's, unchanged; otherwise the patch budget
    is lowered until the padded count fits (the image only ever gets smaller).
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1x1, got {width}x{height}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    size = _resized(width, height, IN_PATCH_LIMIT)
    plan = SizePlan((width, height), size, _padded(*size))
    if max_tokens is None:
        return plan
    if plan.num_tokens <= max_tokens:
        return plan
    budget = min(4 * max_tokens, IN_PATCH_LIMIT)  # patches; a token is 2x2 patches
    while True:
        size = _resized(width, height, budget)
        plan = SizePlan((width, height), size, _padded(*size))
        if plan.num_tokens <= max_tokens:
            return plan
        # Padding pushed the count over: shrink the budget in proportion to the overshoot.
        # Strictly decreasing, and a budget of 0 gives a 1x1 image (1 token), so this ends.
        budget = budget * max_tokens // plan.num_tokens
