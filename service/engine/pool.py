"""Data-parallel encoder pool: one worker process per device, one whole image per worker.

K3's tower has 12 heads, which do not shard over 8 GPUs, so each image goes whole to one
worker (`cuda:0..N-1`, or N CPU workers), chosen by the fewest outstanding patches.

One kind of request: `submit(data, options, plan)` queues an image's encoded bytes, and its
worker (`service.engine.worker`) decodes, preprocesses and encodes them; the future gives the
projector rows. The caller has read the image's header (`vision.plan_image`) and passes the plan:
its patch count weighs the image for scheduling, and it travels to the worker with the bytes, so
the worker does not plan again. So the calling process never decodes pixels, and each process
reads the header once.

Transport: each worker has its own request queue and result pipe, so a worker that dies
mid-write can corrupt nothing another worker uses. Payloads up to `inline_bytes` (1 MiB) are
pickled through them; larger ones go through a shared-memory tensor (`/dev/shm`) and only its
handle is pickled. Measured on a 2-core machine: a fresh shared-memory tensor for a 4 MB payload
cost the parent ~7 ms of CPU, 100 KB pickled through a pipe ~0.1 ms; 12 MB pickled through a pipe
cost the receiver more than a copy out of shared memory.

Queueing: the parent keeps each worker's waiting requests in its own queue and sends a ready
worker at most `MAX_INFLIGHT_PER_WORKER` at a time (one running, one ready so the worker never
idles waiting for the parent; on a GPU the worker preprocesses and uploads the second while the
tower runs the first), and only while what it was sent fits in `max_inflight_bytes` (each image
counted at `HELD_BYTES_PER_PATCH` per patch: what a worker holds for an image before its tower
starts); an idle worker is always sent one. A request still waiting in the parent can be cancelled
(`future.cancel()`, which `asyncio.wrap_future` calls when its task is cancelled) and is then
never sent: a client that gave up (deadline, cancellation) costs no tower time for it. Once
sent, a request runs to the end.

Failure: a worker that dies fails only the images sent to it with the retryable
`WorkerDiedError` and is restarted; the ones still waiting in the parent wait for the restarted
worker. A slot whose worker dies again and again before becoming ready is retired, and its
waiting images move to the other workers. Workers exit on their own if the parent dies, and
`close()` stops and reaps them all.

Start-up: workers are forked from a forkserver that has already imported torch and the worker's
modules (`multiprocessing`'s forkserver, started once per parent process), so a restart costs
the fork and the checkpoint load, not a fresh interpreter importing torch (~2.5 s, 9 s under
load). The forkserver never touches CUDA: each worker initialises it for its own device.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as tmp

from service.cpus import cpu_budget
from service.engine.allocator import KEEP_FREED_BYTES
from service.engine.inputs import MediaInput
from service.engine.worker import pack_bytes, resolve_patchify, unpack_rows, worker_main
from service.errors import Kind, ServiceError
from vision.checkpoint import Checkpoint, CheckpointError
from vision.config import VisionConfig
from vision.decode import DEFAULT_LIMITS, Limits
from vision.encoder import check_checkpoint
from vision.preprocess import ImagePlan

MAX_INFLIGHT_PER_WORKER = 2  # sent to a worker and not yet answered: one running, one ready
MAX_START_FAILURES = 3  # consecutive deaths before "ready" after which a slot is retired
INLINE_BYTES = 1 << 20  # payloads up to this size are pickled; larger ones go through shared memory
# What a worker holds per patch of an image it was sent, before the tower frees anything: the
# padded uint8 image on the host, in the staging buffer and on the device, and the float32 patches.
HELD_BYTES_PER_PATCH = 3 * 14 * 14 * (1 + 1 + 1 + 4)
MAX_INFLIGHT_BYTES = 1 << 30  # per worker
# Imported once by the forkserver, so a worker (re)starts without importing torch again. __main__
# too: a spawned child re-imports the parent's main script, a forked one inherits it.
_PRELOAD = ["__main__", "service.engine.worker"]
_POLL_S = 0.2


class PoolError(ServiceError):
    """Base class of encoder-pool errors (an encoder that cannot start or serve)."""

    kind = Kind.INTERNAL


class WorkerDiedError(PoolError):
    """The worker holding this image died before answering. Retrying (here or elsewhere) is safe."""

    kind = Kind.UNAVAILABLE


class EncodeError(PoolError):
    """The worker ran this image and raised something that is not bad input (a fault; the message
    names it)."""


class PoolClosedError(PoolError):
    """The pool is closed, or has no usable worker left."""

    kind = Kind.UNAVAILABLE


def resolve_devices(devices: str | Sequence[str] | None = None, workers: int | None = None) -> list[str]:
    """Device list, one entry per worker.

    `None`/"auto": `workers` CPU workers if given, else one per CUDA device, else 1 CPU worker;
    "cpu" / "cpu:N": N CPU workers; "cuda:0,1" or ["cuda:0", "cuda:1"]: those devices.
    """
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if devices is None or devices == "auto":
        if workers is not None:
            return ["cpu"] * workers
        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    if isinstance(devices, str):
        if devices == "cpu" or devices.startswith("cpu:"):
            count = devices.partition(":")[2] or str(workers or 1)
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"bad device spec {devices!r}: expected cpu:N with N >= 1")
            return ["cpu"] * int(count)
        if devices.startswith("cuda:"):
            ids = devices[len("cuda:") :].split(",")
            if not all(i.strip().isdigit() for i in ids):
                raise ValueError(f"bad device spec {devices!r}: expected cuda:0,1,...")
            devices = [f"cuda:{int(i)}" for i in ids]
        else:
            raise ValueError(f"bad device spec {devices!r}: use auto, cpu:N or cuda:0,1,...")
    out = [str(torch.device(d)) for d in devices]
    if not out:
        raise ValueError("no devices given")
    cuda = [d for d in out if d.startswith("cuda")]
    if cuda:
        n = torch.cuda.device_count()
        bad = [d for d in cuda if torch.device(d).index is None or torch.device(d).index >= n]
        if bad:
            raise ValueError(f"devices {bad} do not exist here ({n} CUDA device(s) visible)")
    return out


def held_bytes(patches: int) -> int:
    """What a worker holds for an image of `patches` patches it was sent (for `max_inflight_bytes`)."""
    return patches * HELD_BYTES_PER_PATCH


# ---------------------------------------------------------------------------------------------
# Parent side


@dataclass(eq=False)  # compared by identity (`deque.remove`), never by payload
class _Request:
    id: int
    payload: Any  # (packed image bytes, ImageOptions, ImagePlan); dropped once sent
    future: Future
    patches: int


@dataclass
class _Slot:
    index: int
    device: str
    generation: int = 0
    process: Any = None
    requests: Any = None
    results: Connection | None = None
    pid: int | None = None
    ready: bool = False
    retired: str | None = None  # why the slot takes no more work
    restarts: int = 0
    start_failures: int = 0
    outstanding: int = 0  # patches pending or in flight on this slot
    pending: deque[_Request] = field(default_factory=deque)  # not sent yet; their futures can be cancelled
    inflight: dict[int, _Request] = field(default_factory=dict)  # sent to the current worker, by id
    inflight_bytes: int = 0  # HELD_BYTES_PER_PATCH x the patches of `inflight`
    answered: int = 0  # requests its workers ran and answered (a result or an error), all generations
    busy_s: float = 0.0  # seconds it had something in `inflight`, all generations, up to `busy_since`
    busy_since: float | None = None  # monotonic time `inflight` last became non-empty; None while empty
    load_error: str | None = None

    def note_inflight(self) -> None:
        """Account busy time after `inflight` changed (lock held). Busy: holding an image it was sent
        and has not answered (running it, or the next one ready behind it)."""
        busy = bool(self.inflight)
        if busy == (self.busy_since is not None):
            return
        now = time.monotonic()
        if busy:
            self.busy_since = now
        else:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def busy_seconds(self, now: float) -> float:
        """Busy time so far, the current stretch included (lock held)."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)


class EncoderPool:
    """`submit(data, options, plan) -> Future[Tensor]`: the image's projector rows
    `[num_tokens, text_hidden]` on the CPU, encoded by one worker.

    Thread-safe; from asyncio use `asyncio.wrap_future(pool.submit(...))`. A future can be
    cancelled while its request waits in the pool (it is then never encoded), not once a worker
    has it. `limits` are checked again by each worker as it decodes. `patchify`: where workers
    build the float patches, "device", "host" or "auto" (on a GPU, the device; see the worker).
    `keep_freed_bytes`: free memory each worker's malloc arenas keep for the next image
    (`service.engine.allocator`; 0 leaves the workers' allocators as they are).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        devices: str | Sequence[str] | None = None,
        *,
        workers: int | None = None,
        limits: Limits = DEFAULT_LIMITS,
        dtype: torch.dtype | None = None,
        threads_per_worker: int | None = None,
        start_timeout_s: float = 300.0,
        inline_bytes: int = INLINE_BYTES,
        patchify: str = "auto",
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        keep_freed_bytes: int = KEEP_FREED_BYTES,
    ):
        # Fail fast, in the caller, on a bad directory, config or tensor list (before any spawn).
        ckpt = Checkpoint(checkpoint_dir)
        try:
            self.config: VisionConfig = check_checkpoint(ckpt)
        finally:
            ckpt.close()
        self.checkpoint_dir = str(ckpt.path)
        self.devices = resolve_devices(devices, workers)
        for device in self.devices:
            resolve_patchify(patchify, device)  # a bad value fails here, not in every worker
        self.limits = limits
        self.patchify = patchify
        self.max_inflight_bytes = max_inflight_bytes
        # The usable CPUs split between workers: oversubscribed OpenMP threads spin and lose badly.
        self.threads_per_worker = threads_per_worker or cpu_budget().per_worker(len(self.devices))
        self._dtype = dtype
        self._inline_bytes = inline_bytes
        self._keep_freed_bytes = keep_freed_bytes
        self._ctx = tmp.get_context("forkserver")
        # Effective only before this process's forkserver starts (the first pool starts it).
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._slots = [_Slot(i, d) for i, d in enumerate(self.devices)]
        with self._lock:
            for slot in self._slots:
                self._start(slot)
        self._collector = threading.Thread(target=self._collect, name="encoder-pool-collector", daemon=True)
        self._collector.start()
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- public API ----------------------------------------------------------------------------

    def submit(self, item: MediaInput, plan: ImagePlan) -> Future:
        """Queue one item's encoded bytes on the slot with the fewest outstanding patches.
        `plan`: `vision.plan_media` of the item, which the worker preprocesses by (a plan of
        other bytes fails the future with `EncodeError`). Its future stays pending, and can be
        cancelled, until the request is sent to a worker; a bad image body fails it with the
        `ImageError` that `vision.preprocess_image` raises."""
        request = _Request(next(self._ids), (pack_bytes(item.data, self._inline_bytes), item.options, plan), Future(),
                           plan.num_patches)
        with self._lock:
            if self._closed:
                raise PoolClosedError("encoder pool is closed")
            slot = self._least_loaded()
            if slot is None:
                raise PoolClosedError("no usable encoder worker: " + "; ".join(str(s.retired) for s in self._slots))
            self._enqueue(slot, request)
        request.future.add_done_callback(lambda _: self._forget_if_cancelled(request))
        return request.future

    def cpu_idle(self) -> bool:
        """No CPU worker has an image waiting or in work. Read without the lock: a hint for sharing
        the CPUs (an image sent a moment later is not seen)."""
        return not any(s.outstanding for s in self._slots if s.device.startswith("cpu"))

    def health(self) -> dict[str, Any]:
        """Per-worker state, for health checks and metrics. `busy_seconds` only grows: over a window,
        its increase over the window's length is the worker's busy fraction."""
        with self._lock:
            now = time.monotonic()
            workers = [
                {
                    "index": s.index,
                    "device": s.device,
                    "pid": s.pid,
                    "alive": s.process is not None and s.process.is_alive(),
                    "ready": s.ready,
                    "retired": s.retired,
                    "restarts": s.restarts,
                    "pending": len(s.pending),
                    "inflight": len(s.inflight),
                    "inflight_bytes": s.inflight_bytes,
                    "outstanding_patches": s.outstanding,
                    "answered": s.answered,
                    "busy_seconds": s.busy_seconds(now),
                }
                for s in self._slots
            ]
        return {
            "closed": self._closed,
            "serving": not self._closed and any(w["ready"] for w in workers),
            "workers": workers,
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker and reap it. Images not sent to a worker yet fail at once; workers
        first finish what they were sent (up to `timeout_s`), then are terminated, then killed;
        images left unanswered fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here on no slot is restarted and nothing more is sent
            slots = list(self._slots)
            waiting = [f for s in slots for f in self._take_pending(s)]
            procs = [s.process for s in slots if s.process is not None]
            for s in slots:
                if s.process is not None and s.process.is_alive():
                    try:
                        s.requests.put(None)
                    except (OSError, ValueError):
                        pass
        self._fail(waiting, PoolClosedError("encoder pool closed before this image was sent to a worker"))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        if self._collector.is_alive() and threading.current_thread() is not self._collector:
            self._collector.join()
        with self._lock:
            left = [f for s in slots for f in self._take_inflight(s)]
            for s in slots:
                self._discard_channels(s)
        self._fail(left, PoolClosedError("encoder pool closed before this image was encoded"))

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (self._lock held where noted) ------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        """Start a worker in `slot` (lock held). Requests wait in `slot.pending` until it is ready."""
        slot.generation += 1
        slot.ready = False
        slot.pid = None
        slot.requests = self._ctx.Queue()
        receive, send = self._ctx.Pipe(duplex=False)
        slot.results = receive
        slot.process = self._ctx.Process(
            target=worker_main,
            args=(slot.device, self.checkpoint_dir, self._dtype, self.threads_per_worker, self.limits, self.patchify,
                  self._inline_bytes, self._keep_freed_bytes, slot.requests, send),
            name=f"kimi-vision-encoder-{slot.index}",
            daemon=True,
        )
        slot.process.start()
        send.close()  # the child holds the only writer, so its death closes the pipe
        slot.pid = slot.process.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                errors = [s.load_error for s in self._slots if s.load_error]
                if errors:
                    raise CheckpointError(f"encoder worker failed to start: {errors[0]}")
                retired = [s.retired for s in self._slots if s.retired]
                if retired:
                    raise PoolError(f"encoder worker failed to start: {retired[0]}")
                if all(s.ready for s in self._slots):
                    return
            if time.monotonic() > deadline:
                raise PoolError(f"encoder workers not ready after {timeout_s:.0f} s")
            time.sleep(0.02)

    def _collect(self) -> None:
        """Single thread: receive results and notice deaths (sentinels)."""
        while True:
            with self._lock:
                if self._closed and not any(s.process is not None and s.process.is_alive() for s in self._slots):
                    return
                watch: dict[Any, tuple[_Slot, int]] = {}
                for s in self._slots:
                    if s.process is not None and s.results is not None:
                        watch[s.results] = (s, s.generation)
                        watch[s.process.sentinel] = (s, s.generation)
            if not watch:
                time.sleep(_POLL_S)
                continue
            for obj in wait(list(watch), timeout=_POLL_S):
                slot, generation = watch[obj]
                if slot.generation != generation:
                    continue  # restarted since we looked
                if isinstance(obj, Connection):
                    self._receive(slot, generation)
                else:
                    self._drain(slot, generation)
                    self._on_death(slot, generation)

    def _receive(self, slot: _Slot, generation: int) -> bool:
        """Handle one message from `slot`'s worker; False when the pipe is finished."""
        try:
            msg = slot.results.recv()
        except (EOFError, OSError, RuntimeError):
            # EOF: the worker is gone (its sentinel fires next). A result that cannot be read
            # (e.g. a tensor handle from a worker that died right after sending) is lost, so the
            # worker is treated as dead: its images fail retryably and it is restarted.
            proc = slot.process
            if proc is not None and proc.is_alive():
                proc.kill()
            return False
        kind, key, *rest = msg
        del msg
        if kind == "ok":
            rows = unpack_rows(rest.pop())
        with self._lock:
            if slot.generation != generation:
                return True
            if kind == "ready":
                slot.ready, slot.pid, slot.start_failures = True, key, 0
                self._dispatch(slot)
                return True
            if kind == "failed":
                slot.load_error = key
                return True
            slot.answered += 1
            request = slot.inflight.pop(key, None)
            if request is None:
                return True
            slot.outstanding -= request.patches
            slot.inflight_bytes -= held_bytes(request.patches)
            self._dispatch(slot)  # the worker gets its next image before this result is handed over
            slot.note_inflight()  # after the dispatch: a worker handed its next image stays busy
        future = request.future
        # Outside the lock: done-callbacks may call back into the pool.
        if kind == "ok":
            future.set_result(rows)
        elif kind == "bad_image":
            future.set_exception(rest[0])
        else:
            future.set_exception(EncodeError(f"encoder worker {slot.index} ({slot.device}): {rest[0]}"))
        return True

    def _drain(self, slot: _Slot, generation: int) -> None:
        """Take results the worker sent before it exited (they are still good)."""
        while slot.results is not None:
            try:
                if not slot.results.poll():
                    return
            except (OSError, EOFError):
                return
            if not self._receive(slot, generation):
                return

    def _on_death(self, slot: _Slot, generation: int) -> None:
        proc = slot.process
        if proc is None:
            return
        proc.join(1.0)  # its sentinel fired: it has exited, this only reaps it
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        with self._lock:
            if slot.generation != generation:
                return
            error = WorkerDiedError(f"encoder worker died; retry: worker {slot.index} ({slot.device}, pid {slot.pid}) "
                                    f"died ({how})")
            doomed = self._take_inflight(slot)
            was_ready = slot.ready
            self._discard_channels(slot)
            slot.process, slot.ready = None, False
            if self._closed:
                pass
            elif slot.load_error:
                slot.retired = f"worker {slot.index} cannot load the model: {slot.load_error}"
            elif not was_ready and slot.start_failures + 1 >= MAX_START_FAILURES:
                slot.start_failures += 1
                slot.retired = f"worker {slot.index} died {slot.start_failures} times while starting ({how})"
            else:
                slot.start_failures += 0 if was_ready else 1
                slot.restarts += 1
                self._start(slot)  # its pending requests wait for the new worker
            stranded = self._rehome(slot) if slot.retired else []
        self._fail(doomed, error)
        self._fail(stranded, PoolClosedError(f"no usable encoder worker left: {slot.retired}"))

    def _least_loaded(self) -> _Slot | None:
        """The slot for a new request (lock held): workers that are up first, then the fewest
        outstanding patches, ties to the lowest index; None when every slot is retired."""
        usable = [s for s in self._slots if s.retired is None]
        return min(usable, key=lambda s: (not s.ready, s.outstanding, s.index)) if usable else None

    def _enqueue(self, slot: _Slot, request: _Request) -> None:
        """Add `request` to `slot`'s pending queue and send what the worker can take (lock held)."""
        slot.pending.append(request)
        slot.outstanding += request.patches
        self._dispatch(slot)

    def _dispatch(self, slot: _Slot) -> None:
        """Send `slot`'s ready worker pending requests while it holds fewer than
        `MAX_INFLIGHT_PER_WORKER` and they fit in `max_inflight_bytes` (an idle worker always gets
        one), lock held. A cancelled request is dropped here, unsent; a sent one is running and can
        no longer be cancelled."""
        while slot.ready and not self._closed and slot.pending and len(slot.inflight) < MAX_INFLIGHT_PER_WORKER:
            request = slot.pending[0]
            if slot.inflight and slot.inflight_bytes + held_bytes(request.patches) > self.max_inflight_bytes:
                return
            slot.pending.popleft()
            if not request.future.set_running_or_notify_cancel():
                slot.outstanding -= request.patches
                continue
            slot.inflight[request.id] = request
            slot.inflight_bytes += held_bytes(request.patches)
            slot.note_inflight()
            # Non-blocking: the queue's feeder thread pickles and writes it.
            slot.requests.put((request.id, *request.payload))
            request.payload = None

    def _forget_if_cancelled(self, request: _Request) -> None:
        """Done-callback: a request cancelled while pending leaves its queue at once, so its
        patches stop counting and its payload (maybe a large shared-memory tensor) is freed."""
        if not request.future.cancelled():
            return
        with self._lock:
            for slot in self._slots:
                if request in slot.pending:
                    slot.pending.remove(request)
                    slot.outstanding -= request.patches
                    return

    def _rehome(self, retired: _Slot) -> list[Future]:
        """Move a retired slot's pending requests to the other slots (lock held); return the
        futures of those no slot can take, to fail after releasing the lock."""
        stranded = []
        while retired.pending:
            request = retired.pending.popleft()
            retired.outstanding -= request.patches
            target = self._least_loaded()
            if target is not None:
                self._enqueue(target, request)
            elif request.future.set_running_or_notify_cancel():
                stranded.append(request.future)
        return stranded

    @staticmethod
    def _take_pending(slot: _Slot) -> list[Future]:
        """Remove `slot`'s pending requests (lock held) and return the futures not cancelled,
        marked running (so no cancel can race the failure); fail them after releasing the lock."""
        futures = [r.future for r in slot.pending if r.future.set_running_or_notify_cancel()]
        slot.outstanding -= sum(r.patches for r in slot.pending)
        slot.pending.clear()
        return futures

    @staticmethod
    def _take_inflight(slot: _Slot) -> list[Future]:
        """Remove and return what `slot`'s worker was sent (lock held); fail them after releasing it."""
        futures = [r.future for r in slot.inflight.values()]
        slot.outstanding -= sum(r.patches for r in slot.inflight.values())
        slot.inflight.clear()
        slot.inflight_bytes = 0
        slot.note_inflight()
        return futures

    @staticmethod
    def _fail(futures: list[Future], error: Exception) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(error)

    @staticmethod
    def _discard_channels(slot: _Slot) -> None:
        if slot.requests is not None:
            slot.requests.cancel_join_thread()  # never block on a feeder whose reader is dead
            slot.requests.close()
        if slot.results is not None:
            slot.results.close()
        slot.requests = slot.results = None
