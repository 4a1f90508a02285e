"""`kimi-vision batch --engine ray`: the same job on Ray, for a cluster Ray already runs.

Pipeline: the job's lines (whatever the local engine takes: a directory, a list of paths, an
OpenAI-batch JSONL), read by the driver as it goes -> a pool of model actors, one per GPU (or
`--concurrency` CPU actors where there is no GPU), each sent batches of lines, `IN_FLIGHT` at a time
-> the driver. So the driver holds only the lines in flight, never the whole input. (One Ray Data
pipeline over every line would need them all at its start, and a pipeline per window of lines would
load the model again for each.) Each actor holds an engine (`EngineBackend`; an embedding job's has
only the vision components) and runs every item through the same `ItemRunner` as the local engine,
so the rows are the local engine's rows. The driver writes them through the same `Recorder`: the
same shards, fingerprint and exactly-once resume, and the same final reorder into input order; only
the driver writes the output, so the journal's rules hold unchanged. An actor that fails stops the
job (its lines in flight have no row, so a resume runs them).

The actors read the images (paths must be visible to them, as on any shared filesystem; `data:`
URLs travel inside the items; http(s) URLs, with --allow-remote-images, are fetched by the actors).
Ray is an optional dependency (`pip install kimi-vision[ray]`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.batch.backends import EngineBackend
from service.batch.inputs import InputError, Inputs, Item
from service.batch.journal import check, errors_name, finish, prepare
from service.batch.runner import ItemRunner, Recorder, RunOptions, Summary
from service.batch.spec import JobSpec
from service.engine.identity import checkpoint_fingerprint
from vision import DEFAULT_LIMITS, Limits

BATCH_SIZE = 4  # items per actor call (they run concurrently inside it)
IN_FLIGHT = 2  # calls sent to each actor ahead of its results: the next waits while one runs


class ModelActor:
    """One per GPU (or per CPU slot): an engine on its device, running batches of lines."""

    def __init__(self, checkpoint: str, spec: JobSpec, base_dir: str, retries: int, backoff_s: float,
                 limits: Limits) -> None:
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
        backend = EngineBackend.load(Path(checkpoint), device, trunk=spec.task != "embed", limits=limits)
        self.runner = ItemRunner(spec, backend, RunOptions(retries=retries, backoff_s=backoff_s), Path(base_dir))

    def run(self, items: list[Item]) -> list[tuple[dict[str, Any], np.ndarray | None]]:
        """Each item's row (and embedding rows)."""
        return asyncio.run(_process(self.runner, items))


async def _process(runner: ItemRunner, items: list[Item]) -> list[tuple[dict[str, Any], np.ndarray | None]]:
    # Not a method: an actor class with a coroutine method would become an asyncio actor, running
    # the calls sent ahead at once instead of one after another.
    return await asyncio.gather(*(runner.process(item) for item in items))


def run_ray_job(spec: JobSpec, items: Inputs, output: Path, *, resume: bool, checkpoint: Path,
                base_dir: Path, errors: Path | None = None, concurrency: int | None = None,
                address: str | None = None, options: RunOptions | None = None,
                limits: Limits = DEFAULT_LIMITS) -> Summary:
    """Run the job on Ray (connecting to `address`, starting Ray locally, or using the Ray this
    process already initialised); every actor's engine and image reads apply `limits`. Raises
    `ResumeRefused` / `InputError` before any Ray work."""
    try:
        import ray
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


def _run(ray: Any, spec: JobSpec, items: Inputs, output: Path, errors: Path | None,
         fingerprint: dict[str, Any], *, resume: bool, checkpoint: Path, base_dir: Path, concurrency: int | None,
         options: RunOptions, limits: Limits) -> Summary:
    prior = prepare(output, fingerprint, resume=resume, errors=errors)
    summary = Summary(spec.task, len(items), prior.kept, prior=prior)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    options.concurrency = gpus or (concurrency or 1)
    recorder = Recorder(summary, output, len(items) - prior.kept, options)
    pending = (item for item in items if not prior.is_done(item.custom_id))
    actor_class = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)(ModelActor)
    actors: list[Any] = []
    calls: dict[Any, Any] = {}  # a call in flight -> its actor

    def send(actor: Any) -> None:
        batch = list(itertools.islice(pending, BATCH_SIZE))
        if batch:
            calls[actor.run.remote(batch)] = actor

    start = time.monotonic()
    try:
        actors = [actor_class.remote(str(checkpoint), spec, str(base_dir), options.retries, options.backoff_s,
                                     limits)
                  for _ in range(options.concurrency)]
        for actor in actors * IN_FLIGHT:
            send(actor)
        while calls and not summary.aborted:
            (done,), _ = ray.wait(list(calls), num_returns=1)
            actor = calls.pop(done)
            for row, embedding in ray.get(done):
                recorder.record(row, embedding)
            if not summary.aborted:
                send(actor)
    except KeyboardInterrupt:
        summary.interrupted = True
    except InputError as e:  # the input changed under the job (it was read through at the start)
        summary.aborted = str(e)
    except ray.exceptions.RayError as e:
        summary.aborted = f"a Ray actor failed ({type(e).__name__}: {e}); rerun with --resume"
    finally:
        for actor in actors:
            ray.kill(actor)
        recorder.close()
        summary.elapsed_s = time.monotonic() - start
    if summary.complete:
        finish(output, errors)
    return summary
