"""`kimi-vision preprocess` and `kimi-vision preview`, run as real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import REPO_ROOT
from PIL import Image

from vision import preprocess_image

SAMPLES = REPO_ROOT / "samples"
SAMPLE_FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".jpg", ".png", ".gif"))
BIN = Path(sys.executable).parent


def kimi_vision(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_samples_cover_the_promised_cases() -> None:
    modes = {}
    for p in SAMPLE_FILES:
        with Image.open(p) as im:
            modes[p.name] = (im.format, im.mode, im.size, "transparency" in im.info)
    assert modes["photo.jpg"][:2] == ("JPEG", "RGB")
    assert modes["sticker_rgba.png"][1] == "RGBA"
    assert modes["palette_transparent.png"][1] == "P" and modes["palette_transparent.png"][3]
    assert modes["grayscale.png"][1] == "L"
    assert modes["wide_strip.png"][2][0] > 7168
    assert sum(p.stat().st_size for p in SAMPLE_FILES) < 300 * 1024


def test_readme_preprocess_example_runs() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    command = re.search(r"Preprocessing alone, without the service: `(kimi-vision preprocess [^`]*)`", readme).group(1)
    assert (BIN / "kimi-vision").exists(), "the kimi-vision console script is not installed (pip install -e .)"
    result = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    for p in SAMPLE_FILES:
        assert f"samples/{p.name}" in result.stdout
    assert "Traceback" not in result.stderr


def test_json_lines_match_the_library() -> None:
    result = kimi_vision("preprocess", "--json", *map(str, SAMPLE_FILES))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["file"] for r in rows] == list(map(str, SAMPLE_FILES))
    for row, path in zip(rows, SAMPLE_FILES, strict=True):
        out = preprocess_image(path.read_bytes())
        assert (row["orig_width"], row["orig_height"]) == out.orig_size
        assert (row["width"], row["height"]) == out.size
        assert (row["padded_width"], row["padded_height"]) == out.padded_size
        assert tuple(row["grid_thw"]) == out.grid_thw
        assert row["tokens"] == out.num_tokens and row["prompt"] == out.prompt


def test_failing_files_report_and_the_rest_still_run(tmp_path: Path) -> None:
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(SAMPLE_FILES[0].read_bytes()[:300])
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 64)
    missing = tmp_path / "missing.png"
    good = SAMPLES / "photo.jpg"
    result = kimi_vision("preprocess", "--json", str(bad), str(good), str(video), str(missing))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["file"] for r in rows] == [str(bad), str(good), str(video), str(missing)]
    assert set(rows[0]) == {"file", "error"} and "corrupt" in rows[0]["error"]
    assert rows[1]["tokens"] == 414
    assert "video" in rows[2]["error"]
    assert "No such file" in rows[3]["error"]

    table = kimi_vision("preprocess", str(bad), str(good))
    assert table.returncode == 2 and "Traceback" not in table.stderr
    assert f"{bad}: " in table.stderr and "photo.jpg" in table.stdout and "1 failed" in table.stdout


def test_options_reach_the_library() -> None:
    result = kimi_vision("preprocess", "--json", "--max-tokens", "100", "--resize", "fast", str(SAMPLES / "photo.jpg"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] <= 100
    bad = kimi_vision("preprocess", "--max-tokens", "0", str(SAMPLES / "photo.jpg"))
    assert bad.returncode == 2 and "max_tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_preview_writes_the_exact_model_input(tmp_path: Path) -> None:
    for name in ("sticker_rgba.png", "palette_transparent.png", "photo.jpg"):
        out_png = tmp_path / f"{name}.png"
        result = kimi_vision("preview", str(SAMPLES / name), "-o", str(out_png))
        assert result.returncode == 0, result.stderr
        expected = preprocess_image((SAMPLES / name).read_bytes()).image
        with Image.open(out_png) as im:
            assert im.mode == "RGB"
            np.testing.assert_array_equal(np.asarray(im), expected)


def test_preview_grid_draws_token_cells(tmp_path: Path) -> None:
    out_png = tmp_path / "grid.png"
    result = kimi_vision("preview", str(SAMPLES / "photo.jpg"), "-o", str(out_png), "--grid")
    assert result.returncode == 0 and "not the model input" in result.stdout
    plain = preprocess_image((SAMPLES / "photo.jpg").read_bytes()).image
    with Image.open(out_png) as im:
        drawn = np.asarray(im)
    changed = (drawn != plain).any(axis=2)
    assert changed[::28].all() and changed[:, ::28].all()
    inside = np.ones_like(changed)
    inside[::28] = False
    inside[:, ::28] = False
    assert not changed[inside].any(), "only the cell borders are drawn"


def test_preview_errors_are_one_line(tmp_path: Path) -> None:
    result = kimi_vision("preview", str(tmp_path / "nope.png"), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "nope.png" in result.stderr
    lossy = kimi_vision("preview", str(SAMPLES / "photo.jpg"), "-o", str(tmp_path / "x.jpg"))
    assert lossy.returncode == 2 and ".png" in lossy.stderr
