"""One encoder worker process: encoded image bytes in, projector rows out, on one device.

The worker runs the whole vision path for each request it is sent (`ImageEncoder`): decode, resize,
compositing and padding (`vision.preprocess`), the patches (normalised float32 `pixel_values`), and
the tower and projector of `vision.VisionEncoder`. The parent (`service.engine.pool`) has only read
the image's header, and sends the plan it made from it (`vision.ImagePlan`) with the bytes: the
worker sizes its buffers by that plan and opens the header once, only to decode the pixels
(`preprocess_*(plan=)` checks that the header agrees with the plan). Messages:

    parent -> worker  (request id, image bytes, ImageOptions, ImagePlan) | None to stop
    worker -> parent  ("ready", pid) | ("failed", why)                 once, at start
                      ("ok", id, rows) | ("bad_image", id, ImageError) | ("error", id, why)

Patches are built on the device (`patchify="device"`, the default on a GPU): the padded uint8
image goes through the worker's staging buffer to the card (`service.engine.staging`) and
`vision.patchify` builds `pixel_values` there, so the host never writes the float32 patches (4x
the image's bytes) nor copies them to the card. `patchify="host"` (the default on a CPU) builds
them on the host straight from the decoded pixels (`vision.preprocess.preprocess_patches`: the
padded uint8 image is never written), into a buffer the worker reuses (no fresh pages per image).

On a GPU the tower runs asynchronously: after queueing image k the worker takes image k+1 if one
is waiting, decodes it and queues its copy while the card still works on k, then answers k. The
answers keep the order of the requests.

Bytes and rows up to `inline_bytes` are pickled through the queue and pipe; larger ones travel as
a shared-memory tensor (`/dev/shm`) whose handle is pickled (see the pool's module doc). The worker
reads such bytes in place, as a memoryview of the shared memory (`vision.decode` never copies it).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

import cv2
import numpy as np
import torch

from service.engine.allocator import keep_freed_memory
from service.engine.staging import Staging
from vision.buffers import BufferPool
from vision.decode import Limits
from vision.encoder import VisionEncoder
from vision.errors import ImageError
from vision.options import ImageOptions
from vision.patchify import check_normalise, patchify_on_device
from vision.preprocess import ImagePlan, preprocess_image, preprocess_patches

Payload = bytes | torch.Tensor  # inline bytes, or a uint8 shared-memory tensor holding them
PATCHIFY = ("auto", "device", "host")


def resolve_patchify(patchify: str, device: str | torch.device) -> str:
    """"device" or "host": where a worker on `device` builds the float patches ("auto": on a GPU, the device)."""
    if patchify not in PATCHIFY:
        raise ValueError(f"patchify must be one of {PATCHIFY}, got {patchify!r}")
    if patchify == "auto":
        return "device" if torch.device(device).type == "cuda" else "host"
    return patchify


class Launched(NamedTuple):
    """An image whose tower has been queued: its rows on the device, and on a GPU the event that
    marks them computed (None on a CPU, where `launch` returns with them done)."""

    rows: torch.Tensor
    ready: torch.cuda.Event | None


class ImageEncoder:
    """One worker's vision path: encoded bytes -> projector rows on its encoder's device.
    Not thread-safe (one per worker); it owns the buffers every image is built in."""

    def __init__(self, encoder: VisionEncoder, limits: Limits, patchify: str = "auto") -> None:
        self.encoder = encoder
        self.limits = limits
        self.patchify = resolve_patchify(patchify, encoder.device)
        # On a GPU, `launch` returns before the tower has run.
        self.asynchronous = encoder.device.type == "cuda"
        # Rows are read back on their own stream, so reading image k's waits for k's tower only,
        # not for image k+1's, queued behind it on the compute stream.
        self._download = torch.cuda.Stream(encoder.device) if self.asynchronous else None
        self.staging: Staging | None = None
        if self.patchify == "device":
            check_normalise(encoder.device)
            self.staging = Staging(encoder.device)
        else:
            self._patches = BufferPool(np.float32)

    @torch.inference_mode()
    def launch(self, data: bytes | memoryview, options: ImageOptions, plan: ImagePlan) -> Launched:
        """Preprocess one image by its `plan` (`vision.plan_image` of these bytes and options, made by
        the caller) and queue its tower and projector. Raises `ImageError` for bad input, and
        `ValueError` for a plan that is not this image's."""
        if self.staging is not None:
            pre = preprocess_image(data, options, self.limits, out=self.staging.buffer(plan.image_bytes), plan=plan)
            pixels = patchify_on_device(self.staging.upload(pre.image))
            return self._queued(self.encoder.encode([(pixels, pre.grid_thw)])[0])
        with self._patches.take(plan.pixel_values_size) as buffer:
            plan, patches = preprocess_patches(data, options, self.limits, out=buffer, plan=plan)
            # The tower has read the patches (on a GPU: copied them from this pageable buffer) when
            # encode returns, so the buffer can be reused for the next image.
            return self._queued(self.encoder.encode([(patches, plan.grid_thw)])[0])

    def _queued(self, rows: torch.Tensor) -> Launched:
        if not self.asynchronous:
            return Launched(rows, None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(rows.device))
        return Launched(rows, ready)

    def pack(self, launched: Launched, inline_bytes: int) -> tuple[torch.dtype, np.ndarray] | torch.Tensor:
        """The image's rows as they travel to the parent (`pack_rows`), once computed."""
        if launched.ready is None:
            return pack_rows(launched.rows, inline_bytes)
        with torch.cuda.stream(self._download):
            self._download.wait_event(launched.ready)
            return pack_rows(launched.rows, inline_bytes)  # a copy to pageable memory: waits for its stream

    def encode(self, data: bytes | memoryview, options: ImageOptions, plan: ImagePlan) -> torch.Tensor:
        """`launch`, then wait for the rows (on the device)."""
        launched = self.launch(data, options, plan)
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.rows


def _exit_when_parent_dies() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(1)


def worker_main(device: str, checkpoint_dir: str, dtype: torch.dtype | None, threads: int, limits: Limits,
                patchify: str, inline_bytes: int, keep_freed_bytes: int, requests: Any, results: Connection) -> None:
    """The process body (started by the pool from its preloaded forkserver)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    # The worker decodes every image, so it keeps freed image buffers as the engine's process does:
    # with torch imported and glibc's defaults, each 12 MP decode faulted its ~11,600 pages in
    # afresh (85 ms against 59 ms; measured in one process, one core). Not glibc: nothing changes,
    # and the engine's process has already said so.
    if keep_freed_bytes:
        keep_freed_memory(keep_freed_bytes)
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    torch.set_num_threads(threads)
    # Preprocessing's OpenCV calls get the same share of the cores: by default OpenCV runs a
    # thread per core in every worker, and its idle threads spin (measured: ~10 ms of CPU per
    # 640x480 image with 2 workers on 2 cores).
    cv2.setNumThreads(threads)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # CUDA starts here, in the worker, never in its parents
        encoder = ImageEncoder(VisionEncoder.from_checkpoint(checkpoint_dir, device=device, dtype=dtype), limits,
                               patchify)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", os.getpid()))
    serve(encoder, inline_bytes, requests, results)


def serve(encoder: ImageEncoder, inline_bytes: int, requests: Any, results: Connection) -> None:
    """Answer requests until the stop message. On a GPU, image k's answer waits until image k+1
    (when one is already waiting) has been preprocessed and queued, so the two overlap."""
    answers: deque[tuple[Any, ...]] = deque()  # in request order; only the last may still be on the device
    while True:
        if not answers:
            msg = requests.get()
        else:
            try:
                msg = requests.get_nowait()
            except queue.Empty:
                msg = False  # nothing waiting: answer what is queued
        if msg is None:
            for answer in answers:
                _send(encoder, results, answer, inline_bytes)
            return
        running = False
        if msg:
            req_id, payload, options, plan = msg
            del msg
            try:
                answers.append(("ok", req_id, encoder.launch(unpack_bytes(payload), options, plan)))
                running = encoder.asynchronous
            except ImageError as e:  # bad input (ImageError subclasses pickle): the caller gets it as is
                answers.append(("bad_image", req_id, e))
            except Exception as e:  # noqa: BLE001 - one bad image must not kill the worker
                answers.append(("error", req_id, f"{type(e).__name__}: {e}"))
            del payload
        while len(answers) > (1 if running else 0):
            _send(encoder, results, answers.popleft(), inline_bytes)


def _send(encoder: ImageEncoder, results: Connection, answer: tuple[Any, ...], inline_bytes: int) -> None:
    kind, req_id, value = answer
    if kind == "ok":
        try:
            value = encoder.pack(value, inline_bytes)
        except Exception as e:  # noqa: BLE001 - a fault on the device surfaces when the rows are read
            kind, value = "error", f"{type(e).__name__}: {e}"
    results.send((kind, req_id, value))


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
    """Small rows as (dtype, their bytes) pickled by value (numpy has no bfloat16); large ones in
    shared memory, copied there straight from the device (one copy, not two)."""
    if rows.numel() * rows.element_size() <= inline_bytes:
        rows = rows.cpu().contiguous()
        return rows.dtype, rows.view(torch.uint8).numpy()
    shared = torch.empty(rows.shape, dtype=rows.dtype).share_memory_()
    shared.copy_(rows)
    return shared


def unpack_rows(payload: tuple[torch.dtype, np.ndarray] | torch.Tensor) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        # Copy out of shared memory: a held shared-memory tensor pins an open file descriptor, and
        # callers (caches) may keep thousands of embeddings.
        return payload.clone()
    dtype, raw = payload
    return torch.from_numpy(raw).view(dtype)
