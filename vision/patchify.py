"""The padded uint8 image -> `pixel_values` on a torch device (a GPU, or the CPU), bit for bit what
`vision.preprocess.patchify_normalise` builds on the host (docs/MODEL.md §4, steps 5 and 6).

An encoder on a GPU receives the uint8 image (a quarter of the bytes of the float patches) and
builds the patches there, so the host never writes 145 MB of float32 per 12 MP image.

Normalisation is the reference's float expression evaluated in float32:
`(x / 255 - 0.5) * 2`. That equals the reference's (float64 division cast to float32, float64
mean and 1/std) on every uint8 value: float32 division is correctly rounded, and rounding through
float64 first changes no quotient (53 >= 2 * 24 + 2 bits); the float64 subtraction is exact, so
casting it gives what the correctly rounded float32 subtraction gives; times 2 is exact. It holds only if the
device really divides: CUDA turns a division by a Python number into a multiplication by its
reciprocal (wrong on 111 of the 256 values), so the divisor is a tensor on the device.
`check_normalise` runs the expression on the device over all 256 values against the table.
"""

from __future__ import annotations

import numpy as np
import torch

from .navit import PATCH_SIZE
from .preprocess import IMAGE_MEAN, IMAGE_STD, NORMALISE_TABLE


def normalise_(values: torch.Tensor) -> torch.Tensor:
    """In place: float32 tensor holding uint8 values -> the reference's normalised values."""
    divisor = torch.full((), 255.0, dtype=torch.float32, device=values.device)  # a fill, no host sync
    return values.div_(divisor).sub_(IMAGE_MEAN).mul_(1.0 / IMAGE_STD)


def patchify_on_device(image: torch.Tensor) -> torch.Tensor:
    """uint8 `(H, W, 3)` tensor, H and W multiples of 14 -> float32 `[H/14 * W/14, 3, 14, 14]` on the
    image's device: patches in raster order, each channel-major (the host path's layout)."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 (H, W, 3) image, got {image.dtype} {list(image.shape)}")
    h, w, c = image.shape
    p = PATCH_SIZE
    if h % p or w % p:
        raise ValueError(f"image {h}x{w} is not a multiple of the {p}-px patch")
    rows, cols = h // p, w // p
    out = torch.empty((rows, cols, c, p, p), dtype=torch.float32, device=image.device)
    out.copy_(image.view(rows, p, cols, p, c).permute(0, 2, 4, 1, 3))  # re-layout and uint8 -> float32 in one pass
    return normalise_(out).view(rows * cols, c, p, p)


def check_normalise(device: torch.device | str) -> None:
    """Raise RuntimeError unless `normalise_` on `device` gives the reference table on all 256 values."""
    values = torch.arange(256, dtype=torch.float32, device=device)
    got = normalise_(values).cpu().numpy()
    bad = np.flatnonzero(got.view(np.uint32) != NORMALISE_TABLE.view(np.uint32))
    if bad.size:
        raise RuntimeError(f"normalisation on {device} differs from the reference on {bad.size} of 256 values "
                           f"(first: {int(bad[0])} -> {got[bad[0]]!r}, reference {NORMALISE_TABLE[bad[0]]!r})")
