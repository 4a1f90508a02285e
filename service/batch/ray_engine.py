"""`kimi-vision batch --engine ray`: the same job on Ray Data, for a cluster Ray already runs.

Pipeline: the job's lines (whatever the local engine takes: a directory, a list of paths, an
OpenAI-batch JSONL) -> `map_batches` with one model actor per GPU (or `--concurrency` CPU actors
where there is no GPU) -> the driver. Each actor holds an engine (`EngineBackend`; an embedding
job's has only the vision components) and runs every item through the same `ItemRunner` as the
local engine, so the rows are the local engine's rows. The driver writes them through the same
`Recorder`: the same shards, fingerprint and exactly-once resume, and the same final reorder into
input order; only the driver writes the output, so the journal's rules hold unchanged.

The actors read the images (paths must be visible to them, as on any shared filesystem; `data:`
URLs travel inside the items; http(s) URLs, with --allow-remote-images, are fetched by the actors).
Ray is an optional dependency (`pip install kimi-vision[ray]`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.batch.backends import EngineBackend
from service.batch.inputs import InputError, Item
from service.batch.journal import check, errors_name, finish, prepare
from service.batch.runner import ItemRunner, Recorder, RunOptions, Summary
from service.batch.spec import JobSpec
from service.engine.identity import checkpoint_fingerprint
from vision import DEFAULT_LIMITS, Limits

BATCH_SIZE = 4  # items per actor call (they run concurrently inside it)


class ModelActor:
    """One per GPU (or per CPU slot): an engine on its device, running batches of lines."""

    def __init__(self, checkpoint: str, spec: dict[str, Any], base_dir: str, retries: int, backoff_s: float,
                 limits: dict[str, int]) -> None:
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
        self.spec = JobSpec(**spec)
        backend = EngineBackend.load(Path(checkpoint), device, trunk=self.spec.task != "embed",
                                     limits=Limits(**limits))
        self.runner = ItemRunner(self.spec, backend, RunOptions(retries=retries, backoff_s=backoff_s), Path(base_dir))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        items = [Item.from_json(str(text)) for text in batch["item"]]
        results = asyncio.run(self._run(items))
        out: dict[str, list[Any]] = {"row": [], "rows": [], "shape": []}
        for row, embedding in results:
            out["row"].append(json.dumps(row, ensure_ascii=False))
            rows = np.zeros((0, 0), np.float32) if embedding is None else np.ascontiguousarray(embedding)
            out["rows"].append(rows.tobytes())
            out["shape"].append(json.dumps(None if embedding is None else list(rows.shape)))
        return out

    async def _run(self, items: list[Item]) -> list[tuple[dict[str, Any], np.ndarray | None]]:
        return await asyncio.gather(*(self.runner.process(item) for item in items))


def _record(row: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray | None]:
    """An actor's output row -> the (row, embedding rows) the recorder takes."""
    shape = json.loads(row["shape"])
    embedding = None if shape is None else np.frombuffer(bytes(row["rows"]), dtype=np.float32).reshape(shape)
    return json.loads(row["row"]), embedding


def run_ray_job(spec: JobSpec, items: Sequence[Item], output: Path, *, resume: bool, checkpoint: Path,
                base_dir: Path, errors: Path | None = None, concurrency: int | None = None,
                address: str | None = None, options: RunOptions | None = None,
                limits: Limits = DEFAULT_LIMITS) -> Summary:
    """Run the job on Ray (connecting to `address`, starting Ray locally, or using the Ray this
    process already initialised); every actor's engine and image reads apply `limits`. Raises
    `ResumeRefused` / `InputError` before any Ray work."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise InputError("--engine ray needs Ray: pip install 'kimi-vision[ray]'") from None
    options = options or RunOptions()
    checkpoint = Path(os.path.abspath(checkpoint))
    fingerprint = spec.fingerprint(checkpoint_fingerprint(checkpoint), errors_name(output, errors))
    check(output, fingerprint, resume=resume, errors=errors)  # refuse before starting anything

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        return _run(ray, spec, items, output, errors, fingerprint, resume=resume, checkpoint=checkpoint,
                    base_dir=base_dir, concurrency=concurrency, options=options, limits=limits)
    finally:
        if started_ray:
            ray.shutdown()


def _run(ray: Any, spec: JobSpec, items: Sequence[Item], output: Path, errors: Path | None,
         fingerprint: dict[str, Any], *, resume: bool, checkpoint: Path, base_dir: Path, concurrency: int | None,
         options: RunOptions, limits: Limits) -> Summary:
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours is the one progress display

    prior = prepare(output, fingerprint, resume=resume, errors=errors)
    pending = [item for item in items if item.custom_id not in prior.done]
    summary = Summary(spec.task, len(items), len(items) - len(pending), prior=prior)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = gpus or (concurrency or 1)
    options.concurrency = actors
    recorder = Recorder(summary, output, len(pending), options)
    start = time.monotonic()
    try:
        if pending:
            dataset = ray.data.from_items([{"item": item.to_json()} for item in pending]).map_batches(
                ModelActor, batch_size=BATCH_SIZE, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=1 if gpus else 0, num_cpus=1,
                fn_constructor_kwargs={
                    "checkpoint": str(checkpoint), "spec": dataclasses.asdict(spec), "base_dir": str(base_dir),
                    "retries": options.retries, "backoff_s": options.backoff_s, "limits": dataclasses.asdict(limits),
                })
            for row in dataset.iter_rows():
                recorder.record(*_record(row))
                if summary.aborted:
                    break
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        recorder.close()
        summary.elapsed_s = time.monotonic() - start
    if summary.complete:
        finish(output, errors)
    return summary
