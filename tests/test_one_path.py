"""One road from image bytes to embedding rows: `Engine.embed`. Every caller (the gRPC server,
each batch engine: in-process, through a server, on Ray; and `kimi-vision embed`) takes it, so
the same bytes give the same rows, bit for bit, whichever caller asked.

All of them run the embedded default checkpoint with one CPU encoder worker, as a user's default
run would; the reference is `Engine.embed` called directly.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from service.batch.backends import EngineBackend, ServerBackend
from service.batch.inputs import load_items
from service.batch.ray_engine import run_ray_job
from service.batch.runner import Job, RunOptions
from service.batch.spec import JobSpec
from service.engine import EngineConfig, ImageInput
from service.rpc.client import VisionClient
from service.server import ServerConfig, ServerThread

REPO_ROOT = Path(__file__).resolve().parent.parent
NAMES = ["photo.jpg", "sticker_rgba.png", "palette_transparent.png"]
pytestmark = pytest.mark.timeout(300)




@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("one-path")
    for name in NAMES:
        shutil.copy(REPO_ROOT / "samples" / name, root / name)
    return root


@pytest.fixture(scope="module")
def reference(tiny_engine, folder) -> dict[str, np.ndarray]:
    """`Engine.embed`, called directly."""
    async def embed() -> list:
        return await tiny_engine.embed([ImageInput((folder / name).read_bytes()) for name in NAMES])

    return {name: e.rows.numpy() for name, e in zip(NAMES, asyncio.run(embed()), strict=True)}


EMBED = JobSpec("embed")


def _shard_rows(output: Path) -> dict[str, np.ndarray]:
    import json

    rows = {}
    for line in output.read_text().splitlines():
        row = json.loads(line)
        emb = row["response"]["body"]["embedding"]
        rows[row["custom_id"]] = load_file(str(output.parent / emb["file"]))[emb["key"]]
    return rows


def _job(backend, folder: Path, output: Path) -> dict[str, np.ndarray]:
    async def run() -> None:
        options = RunOptions(concurrency=2, tty=False, handle_sigint=False)
        summary = await Job(EMBED, load_items(folder, EMBED), output, backend, resume=False, base_dir=folder,
                            options=options).run()
        assert summary.ok == len(NAMES), summary.line(output)

    asyncio.run(run())
    return _shard_rows(output)


def _assert_same(got: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(reference)
    for name in NAMES:
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)


def test_grpc_embed(tiny_checkpoint, folder, reference):
    with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=tiny_checkpoint, devices="cpu:1")) as server, \
            VisionClient(server.target, timeout=120) as client:
        got = {name: client.embed((folder / name).read_bytes())[1] for name in NAMES}
    _assert_same(got, reference)


def test_batch_in_process_and_through_a_server(tiny_checkpoint, tiny_engine, folder, reference, tmp_path):
    _assert_same(_job(EngineBackend(tiny_engine), folder, tmp_path / "local.jsonl"), reference)

    async def via_server(target: str) -> None:
        backend = await ServerBackend.connect(target)
        try:
            options = RunOptions(concurrency=2, tty=False, handle_sigint=False)
            await Job(EMBED, load_items(folder, EMBED), tmp_path / "server.jsonl", backend, resume=False,
                      base_dir=folder, options=options).run()
        finally:
            await backend.close()

    with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=tiny_checkpoint, devices="cpu:1")) as server:
        asyncio.run(via_server(server.target))
    _assert_same(_shard_rows(tmp_path / "server.jsonl"), reference)


def test_batch_on_ray(tiny_checkpoint, folder, reference, tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        output = tmp_path / "ray.jsonl"
        summary = run_ray_job(EMBED, load_items(folder, EMBED), output, resume=False, checkpoint=tiny_checkpoint,
                              base_dir=folder, concurrency=1, options=RunOptions(tty=False))
        assert summary.ok == len(NAMES)
    finally:
        ray.shutdown()
    _assert_same(_shard_rows(output), reference)


def test_embed_command(tiny_checkpoint, folder, reference, tmp_path):
    out = tmp_path / "embed.safetensors"
    done = subprocess.run([sys.executable, "-m", "service.cli", "embed", "--checkpoint", str(tiny_checkpoint),
                           "--workers", "1", "--out", str(out), *(str(folder / n) for n in NAMES)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    tensors = load_file(str(out))
    _assert_same({Path(key).name: rows for key, rows in tensors.items()}, reference)
