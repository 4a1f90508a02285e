"""Kimi-K3's video configuration and the pure arithmetic around it -- stubbed, not missing.

The released K3 processor rejects every media type but still images, so `preprocess_image`
refuses video bytes with `UnsupportedMediaError`. The configuration below is what the model's
processor config declares for the day video is switched on (docs/MODEL.md §7):
sample at min(8, fps) frames per second, group 4 frames into a chunk, budget 16,384 patches per
frame, and lead each chunk's prompt with an HH:MM:SS.fff timestamp. These functions need no
decoder; they are tested so that the video path, when it arrives, starts from checked parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedMediaError


@dataclass(frozen=True)
class VideoConfig:
    sample_fps: float = 8.0  # frames per second sampled, at most the video's own rate
    frames_per_chunk: int = 4  # temporal_merge_kernel_size: frames merged into one chunk
    patches_per_frame: int = 16384  # in_patch_limit_each_frame


K3_VIDEO = VideoConfig()


def sampling_fps(video_fps: float, config: VideoConfig = K3_VIDEO) -> float:
    """The rate frames are taken at: the configured rate, never faster than the video itself."""
    if not (video_fps > 0 and math.isfinite(video_fps)):
        raise ValueError(f"video fps must be a positive number, got {video_fps!r}")
    return min(config.sample_fps, video_fps)


def select_frames(num_frames: int, video_fps: float, config: VideoConfig = K3_VIDEO) -> list[int]:
    """Indices of the frames to use: `linspace(0, n-1, round(n * sfps / fps)).round()`.

    numpy rounds halves to even, as the reference expression does. A clip shorter than one
    sampling interval (n * sfps / fps < 0.5) selects no frame, as the expression gives.
    """
    if num_frames < 0:
        raise ValueError(f"num_frames must be >= 0, got {num_frames}")
    count = round(num_frames * sampling_fps(video_fps, config) / video_fps)
    if num_frames == 0 or count == 0:
        return []
    return [int(i) for i in np.linspace(0, num_frames - 1, count).round()]


def chunk_frames(indices: list[int], config: VideoConfig = K3_VIDEO) -> list[list[int]]:
    """Consecutive groups of `frames_per_chunk` selected frames; the last group may be shorter."""
    k = config.frames_per_chunk
    return [indices[i : i + k] for i in range(0, len(indices), k)]


def format_timestamp(seconds: float) -> str:
    """`HH:MM:SS.fff`, rounded to the nearest millisecond; hours grow past 99 if needed."""
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"timestamp must be a finite number >= 0, got {seconds!r}")
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, ms = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}.{ms:03d}"


def chunk_timestamps(indices: list[int], video_fps: float, config: VideoConfig = K3_VIDEO) -> list[str]:
    """One timestamp per chunk: the presentation time of the chunk's first frame."""
    if not (video_fps > 0 and math.isfinite(video_fps)):
        raise ValueError(f"video fps must be a positive number, got {video_fps!r}")
    return [format_timestamp(chunk[0] / video_fps) for chunk in chunk_frames(indices, config)]


def refuse_video(what: str = "video") -> None:
    """The processor's answer to any video input today."""
    raise UnsupportedMediaError(
        f"{what}: Kimi-K3's released processor takes still images only and rejects video; "
        "extract frames and send them as images"
    )
