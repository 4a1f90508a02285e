"""`kimi-vision batch --engine ray` on a small local Ray instance gives the rows the local engine gives.

Ray is kept small (2 CPUs, no dashboard, one model actor) and the inputs tiny: starting Ray and its
actors is most of this test's time.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from service.batch.backends import EngineBackend
from service.batch.inputs import load_items
from service.batch.journal import ResumeRefused
from service.batch.ray_engine import run_ray_job
from service.batch.runner import Job, JobSpec, RunOptions
from service.checkpoints.default import default_checkpoint_dir
from service.engine import Engine, EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _rows(output: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len({r["custom_id"] for r in rows}) == len(rows)
    return {r["custom_id"]: r for r in rows}


def _comparable(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k not in ("timings", "embedding")}
    assert set(row["timings"]) <= {"read_ms", "model_ms", "total_ms"}  # the same keys on every engine
    if "embedding" in row:
        out["embedding"] = {k: v for k, v in row["embedding"].items() if k != "file"}
    return out


def _tensor(output: Path, row: dict) -> np.ndarray:
    return load_file(str(output.parent / row["embedding"]["file"]))[row["embedding"]["key"]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-in")
    (folder / "sub").mkdir()
    shutil.copy(REPO_ROOT / "samples" / "grayscale.png", folder / "gray.png")
    shutil.copy(REPO_ROOT / "samples" / "sticker_rgba.png", folder / "sub" / "sticker.png")
    (folder / "sub" / "bad.jpg").write_text("not a JPEG")
    return load_items(folder)


@pytest.fixture(scope="module")
def engine():
    """The local engine the Ray rows are compared with (embedded default checkpoint, one worker)."""
    loaded = Engine.load(EngineConfig(checkpoint=default_checkpoint_dir(), devices="cpu:1", cache_bytes=0))
    yield loaded
    loaded.close()


def _local(spec: JobSpec, items, output: Path, engine) -> None:
    async def go():
        options = RunOptions(concurrency=2, tty=False, handle_sigint=False)
        return await Job(spec, items, output, EngineBackend(engine), resume=False, options=options).run()

    asyncio.run(go())


def test_ray_embed_rows_equal_local_rows(local_ray, inputs, engine, tmp_path):
    checkpoint = default_checkpoint_dir()
    spec = JobSpec("embed")
    local_out = tmp_path / "local.jsonl"
    _local(spec, inputs, local_out, engine)

    ray_out = tmp_path / "ray.jsonl"
    summary = run_ray_job(spec, inputs, ray_out, resume=False, checkpoint=checkpoint, concurrency=1,
                          options=RunOptions(tty=False))
    assert (summary.ok, summary.errors, summary.exit_code) == (2, 1, 0)
    local, via_ray = _rows(local_out), _rows(ray_out)
    assert sorted(via_ray) == ["gray.png", "sub/bad.jpg", "sub/sticker.png"]
    assert {k: _comparable(v) for k, v in via_ray.items()} == {k: _comparable(v) for k, v in local.items()}
    for name in ("gray.png", "sub/sticker.png"):
        np.testing.assert_array_equal(_tensor(ray_out, via_ray[name]), _tensor(local_out, local[name]))
    # The fingerprints match too: a Ray job may resume a local one and vice versa.
    assert Path(str(ray_out) + ".job.json").read_text() == Path(str(local_out) + ".job.json").read_text()

    # A finished job resumed on Ray does nothing; changed options are refused before any Ray work.
    again = run_ray_job(spec, inputs, ray_out, resume=True, checkpoint=checkpoint, options=RunOptions(tty=False))
    assert (again.skipped, again.processed) == (3, 0)
    with pytest.raises(ResumeRefused, match="task: was \"embed\", now \"caption\""):
        run_ray_job(JobSpec("caption"), inputs, ray_out, resume=True, checkpoint=checkpoint)


def test_ray_takes_jsonl_input_and_gives_the_local_rows(local_ray, engine, tmp_path):
    """An OpenAI-batch JSONL (an inline data: URL, a path, a bad image) on Ray: the local rows."""
    import base64

    gray = (REPO_ROOT / "samples" / "grayscale.png").read_bytes()
    shutil.copy(REPO_ROOT / "samples" / "sticker_rgba.png", tmp_path / "sticker.png")
    (tmp_path / "bad.png").write_bytes(b"not a PNG")
    lines = [{"custom_id": name, "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}], "max_tokens": 3}}
        for name, url in [("inline", "data:image/png;base64," + base64.b64encode(gray).decode()),
                          ("by-path", "sticker.png"), ("bad", "bad.png")]]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    via_ray = _captions_local_and_on_ray(load_items(source), engine, tmp_path)
    assert via_ray["inline"]["tokens"]["completion"] == 3  # the row's own max_tokens


def _captions_local_and_on_ray(items, engine, tmp_path: Path) -> dict[str, dict]:
    """Caption `items` (two good images, one bad) locally and on Ray; the rows must agree."""
    spec = JobSpec("caption", max_new_tokens=5)
    local_out, ray_out = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    _local(spec, items, local_out, engine)
    summary = run_ray_job(spec, items, ray_out, resume=False, checkpoint=default_checkpoint_dir(), concurrency=1,
                          options=RunOptions(tty=False))
    assert (summary.ok, summary.errors) == (2, 1)
    local, via_ray = _rows(local_out), _rows(ray_out)
    assert {k: _comparable(v) for k, v in via_ray.items()} == {k: _comparable(v) for k, v in local.items()}
    return via_ray


def test_ray_caption_rows_equal_local_rows(local_ray, inputs, engine, tmp_path):
    via_ray = _captions_local_and_on_ray(inputs, engine, tmp_path)
    assert via_ray["gray.png"]["tokens"]["completion"] == 5
    assert via_ray["sub/bad.jpg"]["error"].startswith("bad image: messages[0].content[0]: not a recognised image")
