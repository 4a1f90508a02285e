"""`kimi-vision batch --engine ray`: the same job on Ray Data, for a cluster Ray already runs.

Pipeline: `read_binary_files` (the input images) -> `map` (preprocessing, on any CPU; a bad
image becomes an error record, never a failed task) -> `map_batches` with one model actor per
GPU (or `--concurrency` CPU actors where there is no GPU) -> the driver, which writes every record
through the same `Recorder` as the local engine: the same rows, shards, fingerprint and
exactly-once resume. Only the driver writes the output, so the journal's rules hold unchanged.

Actors: an embedding job's actor holds only the vision encoder; a caption/OCR job's actor loads
the service `Engine` (tokenizer, trunk and a one-worker encoder pool on its device) and feeds it
the preprocessed images. Ray is an optional dependency (`pip install kimi-vision[ray]`).

Inputs: a directory or a path list (JSONL rows may hold inline images and several images per
chat, which `read_binary_files` does not express; run those with the local engine or --server).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.batch.backends import Caption, Embedding, local_identity
from service.batch.inputs import InputError, Item
from service.batch.journal import check, prepare
from service.batch.runner import JobSpec, Recorder, RunOptions, Summary, caption_row, embed_row, error_row


def _preprocess(row: dict[str, Any], where: str = "") -> dict[str, Any]:
    """One image file -> the model input (uint8 padded image; patches are made in the actor).
    `where` prefixes errors as the engine does (the image's place in the chat, for captions)."""
    from service.engine import EngineConfig
    from vision import ImageError, Limits, preprocess_image

    start = time.perf_counter()
    defaults = EngineConfig()  # the service's per-image limits
    out: dict[str, Any] = {"path": row["path"], "error": "", "image": b"", "height": 0, "width": 0,
                           "grid": [0, 0, 0], "num_tokens": 0, "prompt": ""}
    try:
        pre = preprocess_image(bytes(row["bytes"]),
                               limits=Limits(max_bytes=defaults.max_image_bytes, max_pixels=defaults.max_image_pixels))
    except ImageError as e:
        out["error"] = f"bad image: {where}{e}"
    else:
        out.update(image=pre.image.tobytes(), height=pre.image.shape[0], width=pre.image.shape[1],
                   grid=list(pre.grid_thw), num_tokens=int(pre.num_tokens), prompt=pre.prompt)
    out["preprocess_ms"] = round((time.perf_counter() - start) * 1000, 1)
    return out


class ModelActor:
    """One per GPU (or per CPU slot): runs the model on a batch of preprocessed images."""

    def __init__(self, checkpoint: str, task: str, prompt: str | None, max_new_tokens: int | None) -> None:
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
        self.spec = JobSpec(task, prompt, max_new_tokens)
        if task == "embed":
            from vision.encoder import VisionEncoder

            self.encoder = VisionEncoder.from_checkpoint(checkpoint, device=device)
            self.engine = None
        else:
            from service.engine import Engine, EngineConfig

            self.engine = Engine.load(EngineConfig(checkpoint=checkpoint, devices=device, cache_bytes=0))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in ("path", "error", "transient", "result", "rows", "model_ms",
                                                    "preprocess_ms")}
        for i in range(len(batch["path"])):
            start = time.perf_counter()
            error, transient, result, rows = str(batch["error"][i]), False, "", b""
            if not error:
                try:
                    result, rows = self._run_one({k: batch[k][i] for k in batch})
                except Exception as e:  # noqa: BLE001 - classified like the local engine's failures
                    from service.batch.backends import local_failure

                    failure = local_failure(e)
                    if failure is None:
                        raise
                    error, transient = failure.message, failure.transient
            out["path"].append(str(batch["path"][i]))
            out["error"].append(error)
            out["transient"].append(transient)
            out["result"].append(result)
            out["rows"].append(rows)
            out["model_ms"].append(round((time.perf_counter() - start) * 1000, 1))
            out["preprocess_ms"].append(float(batch["preprocess_ms"][i]))
        return out

    def _run_one(self, row: dict[str, Any]) -> tuple[str, bytes]:
        """(JSON of the result fields, float32 embedding bytes or b"")."""
        import threading

        import torch

        from vision.preprocess import patchify_normalise

        image = np.frombuffer(bytes(row["image"]), dtype=np.uint8).reshape(int(row["height"]), int(row["width"]), 3)
        grid = tuple(int(v) for v in row["grid"])
        pixels = torch.from_numpy(patchify_normalise(image))
        if self.engine is None:
            with torch.inference_mode():
                (emb,) = self.encoder.encode([(pixels, grid)])
            rows = emb.float().cpu().contiguous().numpy()
            return json.dumps({"shape": list(rows.shape), "grid": list(grid), "num_tokens": int(row["num_tokens"])}), \
                rows.tobytes()
        from service.batch.backends import CHAT_KWARGS
        from service.engine import ChatInput, ImageEmbedding
        from textcore.generate import SamplingParams
        from textcore.parser import ContentDelta

        engine = self.engine
        embedding_rows = engine.pool.submit((pixels, grid)).result()
        embedding = ImageEmbedding("", embedding_rows, grid, int(row["num_tokens"]), str(row["prompt"]))
        chat = ChatInput(messages=self.spec.image_chat(), kwargs=dict(CHAT_KWARGS))
        pieces: list[str] = []
        params = SamplingParams(max_new_tokens=self.spec.effective_max_new_tokens)

        def emit(event: Any) -> None:
            if isinstance(event, ContentDelta):
                pieces.append(event.text)

        result = engine.generate(chat, [embedding], params, emit, threading.Event())
        return json.dumps({"text": "".join(pieces), "finish_reason": result.finish_reason,
                           "prompt_tokens": result.prompt_tokens, "image_tokens": result.image_tokens,
                           "completion_tokens": result.completion_tokens}), b""


def _record(spec: JobSpec, custom_id: str, row: dict[str, Any]) -> tuple[dict[str, Any], Embedding | None]:
    timings = {"preprocess_ms": row["preprocess_ms"], "model_ms": row["model_ms"]}
    if row["error"]:
        return error_row(custom_id, str(row["error"]), bool(row["transient"]), timings), None
    result = json.loads(row["result"])
    if spec.task == "embed":
        rows = np.frombuffer(bytes(row["rows"]), dtype=np.float32).reshape(result["shape"])
        embedding = Embedding(rows, tuple(result["grid"]), result["num_tokens"])
        return embed_row(custom_id, embedding, timings), embedding
    caption = Caption(result["text"], result["finish_reason"], result["prompt_tokens"], result["image_tokens"],
                      result["completion_tokens"])
    return caption_row(custom_id, caption, timings), None


def run_ray_job(spec: JobSpec, items: Sequence[Item], output: Path, *, resume: bool, checkpoint: str | None = None,
                concurrency: int | None = None, address: str | None = None,
                options: RunOptions | None = None) -> Summary:
    """Run the job on Ray (connecting to `address`, starting Ray locally, or using the Ray this
    process already initialised). Raises `ResumeRefused` / `InputError` before any Ray work."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise InputError("--engine ray needs Ray: pip install 'kimi-vision[ray]'") from None
    if any(item.messages is not None or item.images[0].path is None for item in items):
        raise InputError("--engine ray takes a directory or a list of image paths; run JSONL input with "
                         "--engine local or --server")
    options = options or RunOptions()
    if checkpoint is None:
        from service.default_checkpoint import default_checkpoint_dir

        checkpoint = str(default_checkpoint_dir())
    checkpoint = os.path.abspath(checkpoint)
    fingerprint = spec.fingerprint(local_identity(checkpoint))
    check(output, fingerprint, resume=resume)  # refuse before starting anything

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        return _run(ray, spec, items, output, fingerprint, resume=resume, checkpoint=checkpoint,
                    concurrency=concurrency, options=options)
    finally:
        if started_ray:
            ray.shutdown()


def _run(ray: Any, spec: JobSpec, items: Sequence[Item], output: Path, fingerprint: dict[str, Any], *, resume: bool,
         checkpoint: str, concurrency: int | None, options: RunOptions) -> Summary:
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours is the one progress display

    prior = prepare(output, fingerprint, resume=resume)
    pending = [item for item in items if item.custom_id not in prior.done]
    summary = Summary(spec.task, len(items), len(items) - len(pending), prior=prior)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = gpus or (concurrency or 1)
    options.concurrency = actors
    by_path = {os.path.abspath(item.images[0].path): item.custom_id for item in pending}
    recorder = Recorder(summary, output, len(pending), options)
    start = time.monotonic()
    try:
        if pending:
            dataset = (
                ray.data.read_binary_files(list(by_path), include_paths=True, ignore_missing_paths=True)
                .map(_preprocess, fn_kwargs={"where": "" if spec.task == "embed" else "messages[0].content[0]: "})
                .map_batches(ModelActor, batch_size=4, batch_format="numpy",
                             compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=1 if gpus else 0, num_cpus=1,
                             fn_constructor_kwargs={"checkpoint": checkpoint, "task": spec.task,
                                                    "prompt": spec.prompt, "max_new_tokens": spec.max_new_tokens})
            )
            for row in dataset.iter_rows():
                custom_id = by_path.pop(os.path.abspath(row["path"]))
                recorder.record(*_record(spec, custom_id, row))
                if summary.aborted:
                    break
        for path, custom_id in list(by_path.items()) if not summary.aborted else []:
            # read_binary_files skips files that vanished; they still get their row.
            recorder.record(error_row(custom_id, f"{path}: no such file", False, {}))
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        recorder.close()
        summary.elapsed_s = time.monotonic() - start
    return summary
