"""`kimi-vision batch --engine ray` on a small local Ray instance gives the rows the local engine gives.

Ray is kept small (2 CPUs, no dashboard, one model actor) and the inputs tiny: starting Ray and its
actors is most of this test's time.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
from images import MIB, check_limited_rows, limit_images
from openai_batch import check_mixed_output, comparable, image_server, validated_rows, write_mixed_input
from safetensors.numpy import load_file

from service.batch.backends import EngineBackend
from service.batch.inputs import base_dir, load_items
from service.batch.journal import ResumeRefused
from service.batch.ray_engine import run_ray_job
from service.batch.runner import Job, RunOptions
from service.batch.spec import JobSpec
from service.checkpoints.default import default_checkpoint_dir
from vision import Limits

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _tensor(output: Path, row: dict) -> np.ndarray:
    ref = row["response"]["body"]["embedding"]
    return load_file(str(output.parent / ref["file"]))[ref["key"]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ray-in")
    (folder / "sub").mkdir()
    shutil.copy(REPO_ROOT / "samples" / "grayscale.png", folder / "gray.png")
    shutil.copy(REPO_ROOT / "samples" / "sticker_rgba.png", folder / "sub" / "sticker.png")
    (folder / "sub" / "bad.jpg").write_text("not a JPEG")
    return folder


def _local(spec: JobSpec, source: Path, output: Path, tiny_engine) -> None:
    async def go():
        options = RunOptions(concurrency=2, tty=False, handle_sigint=False)
        return await Job(spec, load_items(source, spec), output, EngineBackend(tiny_engine), resume=False,
                         base_dir=base_dir(source), options=options).run()

    asyncio.run(go())


def _on_ray(spec: JobSpec, source: Path, output: Path, **kwargs):
    return run_ray_job(spec, load_items(source, spec), output, checkpoint=default_checkpoint_dir(),
                       base_dir=base_dir(source), options=RunOptions(tty=False), **kwargs)


def test_ray_embed_rows_equal_local_rows(local_ray, folder, tiny_engine, tmp_path):
    spec = JobSpec("embed")
    local_out = tmp_path / "local.jsonl"
    _local(spec, folder, local_out, tiny_engine)

    ray_out = tmp_path / "ray.jsonl"
    summary = _on_ray(spec, folder, ray_out, resume=False, concurrency=1)
    assert (summary.ok, summary.errors, summary.exit_code) == (2, 1, 0)
    local, via_ray = validated_rows(local_out), validated_rows(ray_out)
    assert [r["custom_id"] for r in via_ray] == ["gray.png", "sub/bad.jpg", "sub/sticker.png"]  # input order
    assert [comparable(r) for r in via_ray] == [comparable(r) for r in local]
    for row, ref in zip(via_ray, local, strict=True):
        if row["response"]["status_code"] == 200:
            np.testing.assert_array_equal(_tensor(ray_out, row), _tensor(local_out, ref))
    # The fingerprints match too: a Ray job may resume a local one and vice versa.
    assert Path(str(ray_out) + ".job.json").read_text() == Path(str(local_out) + ".job.json").read_text()

    # A finished job resumed on Ray does nothing; changed options are refused before any Ray work.
    again = _on_ray(spec, folder, ray_out, resume=True)
    assert (again.skipped, again.processed) == (3, 0)
    with pytest.raises(ResumeRefused, match="task: was \"embed\", now \"caption\""):
        _on_ray(JobSpec("caption"), folder, ray_out, resume=True)


def test_ray_mixed_requests_give_the_local_rows(local_ray, tiny_engine, tmp_path):
    """The mixed request file (remote images from a real HTTP server on 127.0.0.1, fetched by the
    actors) on Ray: one row per line, in input order, the local engine's rows."""
    spec = JobSpec("caption", allow_remote_images=True, allowed_media_domains=("127.0.0.1",))
    with image_server(tmp_path / "in") as remote:
        source = write_mixed_input(tmp_path / "in", remote)
        local_out, ray_out = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
        _local(spec, source, local_out, tiny_engine)
        summary = _on_ray(spec, source, ray_out, resume=False, concurrency=1)
    assert summary.exit_code == 0
    via_ray = check_mixed_output(ray_out)
    assert [comparable(r) for r in via_ray] == [comparable(r) for r in check_mixed_output(local_out)]


def test_ray_actors_apply_the_limits(local_ray, tmp_path):
    """The job's limits reach each actor's engine and image reads (`batch --engine ray --max-image-mb`)."""
    images = limit_images(tmp_path / "in")
    output = tmp_path / "ray.jsonl"
    summary = _on_ray(JobSpec("embed"), images, output, resume=False, concurrency=1,
                      limits=Limits(max_bytes=40 * MIB, max_pixels=1_000_000))
    assert (summary.ok, summary.errors) == (1, 1)
    check_limited_rows(output)
