"""The plain, straightforward Kimi-K3 image preprocessing, written from docs/MODEL.md §4-§6 step
by step with no optimisation. Tests hold the project path to it bit for bit; bench/preprocess.py
times it as "the straightforward path"."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image


def reference_size(width: int, height: int) -> tuple[int, int]:
    s1 = math.sqrt(65536 / (max(1, width // 14) * max(1, height // 14)))
    s2 = 7168 / width
    s3 = 7168 / height
    scale = min(1, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), 7168)
    new_h = min(max(1, int(height * scale)), 7168)
    return new_w, new_h


def reference_fill(image: Image.Image) -> np.ndarray:
    if image.mode == "RGB":
        return np.asarray(image)
    if "A" not in image.getbands() and "transparency" not in image.info:
        return np.asarray(image.convert("RGB"))
    rgba = np.asarray(image.convert("RGBA"))
    height, width = rgba.shape[:2]
    background = np.full((height, width, 3), 255, dtype=np.uint8)
    y = np.arange(height)[:, None]
    x = np.arange(width)[None, :]
    background[((y // 8) + (x // 8)) % 2 == 1] = 180
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    out = alpha * rgba[:, :, :3] + (1 - alpha) * background
    return out.astype(np.uint8)


def reference_image(data: bytes) -> tuple[tuple[int, int], tuple[int, int], np.ndarray]:
    """(original size, resized size, padded uint8 image): the steps before normalisation."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    new_w, new_h = reference_size(width, height)
    image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    array = reference_fill(image)
    pad_h = (28 - new_h % 28) % 28
    pad_w = (28 - new_w % 28) % 28
    array = np.pad(array, ((0, pad_h), (0, pad_w), (0, 0)), mode="constant", constant_values=0)
    return (width, height), (new_w, new_h), array


def reference_preprocess(data: bytes) -> dict:
    (width, height), (new_w, new_h), array = reference_image(data)
    x = (array / 255.0).astype(np.float32)
    x = x - np.array([0.5, 0.5, 0.5])
    x = x * (1.0 / np.array([0.5, 0.5, 0.5]))
    x = x.astype(np.float32)
    hp, wp = array.shape[:2]
    patches = x.reshape(hp // 14, 14, wp // 14, 14, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 14, 14)
    return {
        "orig_size": (width, height),
        "size": (new_w, new_h),
        "padded_size": (wp, hp),
        "grid_thw": (1, hp // 14, wp // 14),
        "num_tokens": (hp // 28) * (wp // 28),
        "prompt": f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>",
        "image": array,
        "pixel_values": patches,
    }
