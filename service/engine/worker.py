"""One encoder worker process: encoded image bytes in, projector rows out, on one device.

The worker runs the whole vision path for each request it is sent: `vision.preprocess_image`
(decode, resize, compositing, padding) and the tower and projector of `vision.VisionEncoder`. The
parent (`service.engine.pool`) has only read the image's header. Messages:

    parent -> worker  (request id, image bytes, ImageOptions) | None to stop
    worker -> parent  ("ready", pid) | ("failed", why)                 once, at start
                      ("ok", id, rows) | ("bad_image", id, ImageError) | ("error", id, why)

Bytes and rows up to `inline_bytes` are pickled through the queue and pipe; larger ones travel as
a shared-memory tensor (`/dev/shm`) whose handle is pickled (see the pool's module doc).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

import cv2
import numpy as np
import torch

from vision.decode import Limits
from vision.encoder import VisionEncoder
from vision.errors import ImageError
from vision.options import ImageOptions
from vision.preprocess import preprocess_image

Payload = bytes | torch.Tensor  # inline bytes, or a uint8 shared-memory tensor holding them


def _exit_when_parent_dies() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(1)


def worker_main(device: str, checkpoint_dir: str, dtype: torch.dtype | None, threads: int, limits: Limits,
                inline_bytes: int, requests: Any, results: Connection) -> None:
    """The process body (spawned by the pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    torch.set_num_threads(threads)
    # Preprocessing's OpenCV calls get the same share of the cores: by default OpenCV runs a
    # thread per core in every worker, and its idle threads spin (measured: ~10 ms of CPU per
    # 640x480 image with 2 workers on 2 cores).
    cv2.setNumThreads(threads)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        encoder = VisionEncoder.from_checkpoint(checkpoint_dir, device=device, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", os.getpid()))
    while True:
        msg = requests.get()
        if msg is None:
            return
        req_id, payload, options = msg
        del msg
        try:
            rows = encode_bytes(encoder, unpack_bytes(payload), options, limits)
            del payload
            results.send(("ok", req_id, pack_rows(rows, inline_bytes)))
        except ImageError as e:  # bad input (ImageError subclasses pickle): the caller gets it as is
            results.send(("bad_image", req_id, e))
        except Exception as e:  # noqa: BLE001 - one bad image must not kill the worker
            results.send(("error", req_id, f"{type(e).__name__}: {e}"))


@torch.inference_mode()
def encode_bytes(encoder: VisionEncoder, data: bytes | memoryview, options: ImageOptions,
                 limits: Limits) -> torch.Tensor:
    """Encoded image bytes -> projector rows `[num_tokens, text_hidden]`: the one vision path."""
    return encoder.encode([preprocess_image(data, options, limits)])[0]


# -- transport ---------------------------------------------------------------------------------


def pack_bytes(data: bytes, inline_bytes: int) -> Payload:
    """Image bytes as they travel to a worker: pickled when small, else in shared memory."""
    if len(data) <= inline_bytes:
        return data
    shared = torch.empty(len(data), dtype=torch.uint8).share_memory_()
    # numpy's single-threaded copy, not `Tensor.copy_`: in the parent, torch's OpenMP threads would
    # wake for a large copy and then spin, costing the workers CPU.
    shared.numpy()[...] = np.frombuffer(data, dtype=np.uint8)
    return shared


def unpack_bytes(payload: Payload) -> bytes | memoryview:
    return memoryview(payload.numpy()) if isinstance(payload, torch.Tensor) else payload


def pack_rows(rows: torch.Tensor, inline_bytes: int) -> tuple[torch.dtype, np.ndarray] | torch.Tensor:
    """Small rows as (dtype, their bytes) pickled by value (numpy has no bfloat16); large ones in shared memory."""
    rows = rows.cpu().contiguous()
    if rows.nbytes <= inline_bytes:
        return rows.dtype, rows.view(torch.uint8).numpy()
    return rows.share_memory_()


def unpack_rows(payload: tuple[torch.dtype, np.ndarray] | torch.Tensor) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        # Copy out of shared memory: a held shared-memory tensor pins an open file descriptor, and
        # callers (caches) may keep thousands of embeddings.
        return payload.clone()
    dtype, raw = payload
    return torch.from_numpy(raw).view(dtype)
