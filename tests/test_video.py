"""The stubbed video configuration: frame selection, chunking, timestamps, and the refusal."""

from __future__ import annotations

import numpy as np
import pytest

from vision import UnsupportedMediaError, preprocess_image
from vision.video import (
    K3_VIDEO,
    chunk_frames,
    chunk_timestamps,
    format_timestamp,
    refuse_video,
    sampling_fps,
    select_frames,
)


def test_config_matches_the_processor_config() -> None:
    assert K3_VIDEO.sample_fps == 8.0
    assert K3_VIDEO.frames_per_chunk == 4
    assert K3_VIDEO.patches_per_frame == 16384


def test_sampling_rate_never_exceeds_the_video() -> None:
    assert sampling_fps(30.0) == 8.0
    assert sampling_fps(5.0) == 5.0
    with pytest.raises(ValueError):
        sampling_fps(0)


def test_select_frames_follows_the_linspace_expression() -> None:
    # 10 s at 30 fps -> 80 frames spread over 0..299.
    picked = select_frames(300, 30.0)
    assert len(picked) == 80 and picked[0] == 0 and picked[-1] == 299
    assert picked == [int(v) for v in np.linspace(0, 299, 80).round()]
    assert all(b > a for a, b in zip(picked, picked[1:], strict=False))
    # Slower than the sampling rate: every frame.
    assert select_frames(12, 6.0) == list(range(12))
    # Half-to-even rounding of the count and the indices, as numpy/Python do.
    assert len(select_frames(15, 48.0)) == round(15 * 8 / 48)  # 2.5 -> 2
    assert select_frames(0, 30.0) == [] and select_frames(1, 30.0) == []


def test_chunks_of_four() -> None:
    assert chunk_frames(list(range(10))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunk_frames([]) == []


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "00:00:00.000"), (0.5, "00:00:00.500"), (61.25, "00:01:01.250"), (3723.0005, "01:02:03.000"),
     (3723.0015, "01:02:03.002"), (59.9996, "00:01:00.000"), (360000, "100:00:00.000")],
)
def test_timestamps(seconds: float, text: str) -> None:
    assert format_timestamp(seconds) == text


def test_chunk_timestamps_use_each_chunks_first_frame() -> None:
    picked = select_frames(300, 30.0)
    stamps = chunk_timestamps(picked, 30.0)
    assert len(stamps) == 20 and stamps[0] == "00:00:00.000"
    assert stamps[1] == format_timestamp(picked[4] / 30.0)
    with pytest.raises(ValueError):
        format_timestamp(-1)


def test_video_is_refused_with_the_reason() -> None:
    with pytest.raises(UnsupportedMediaError, match="rejects video"):
        refuse_video("clip.mp4")
    mp4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 100
    with pytest.raises(UnsupportedMediaError, match="video"):
        preprocess_image(mp4)
