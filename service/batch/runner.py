"""The batch job: the row each input line gets (`ItemRunner`, which the Ray engine's actors run
too), and the asyncio runner (`Job`) that keeps `concurrency` lines in flight on a backend and,
when every line has its row, puts the output in input order (`journal.finish`).

Every line takes one path: its request is checked (`requests.py`; a malformed line, an unsupported
parameter or another model is that line's error row), its images are fetched (`MediaFetcher`:
data: URLs, local files, http(s) with --allow-remote-images by the server's rules, a line's concurrently;
each under the backend's per-image byte limit, so an image the model would refuse is never read
whole), then the backend generates or embeds.
Failures are classified by the service's one taxonomy (`service.errors`): a kind that is not
retried (bad image, bad request, too large) is recorded as an error row and the job goes on; a
retried one (overloaded, unavailable, internal) is retried a few times with backoff, then recorded
(the next `--resume` runs it again). Too many transient failures in a row (a dead server) stop the
job, and so does a refused token (the unauthenticated kind: every line would be refused alike). A
bug (an exception with no kind) also stops it: writing two million error rows for one bug helps
nobody. Ctrl-C (or `stop()`) stops taking lines, cancels those in flight (they have no row,
so a resume runs them), writes what is buffered and fsyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.batch.backends import Backend
from service.batch.inputs import InputError, Inputs, Item
from service.batch.journal import Prior, RowWriter, errors_name, finish, prepare
from service.batch.progress import Progress
from service.batch.requests import chat_request, embedding_request
from service.batch.rows import embedding_body, error_message, error_row, is_ok, is_transient, ok_row
from service.batch.shards import ShardWriter
from service.batch.spec import EMBED_DTYPE, JobSpec
from service.errors import Failure, NotFound, classify
from service.fetch import MediaFetcher
from service.openai.response import completion, new_id


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


# -- the runner ----------------------------------------------------------------------------------


@dataclass
class Summary:
    task: str
    inputs: int
    skipped: int  # done by an earlier run (the rows it kept)
    ok: int = 0
    errors: int = 0  # permanent, recorded
    transient: int = 0  # recorded as transient; a --resume retries them
    elapsed_s: float = 0.0
    interrupted: bool = False
    aborted: str | None = None  # why the job stopped early
    prior: Prior = field(default_factory=Prior)

    @property
    def processed(self) -> int:
        return self.ok + self.errors + self.transient

    @property
    def rate(self) -> float:
        return self.processed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def complete(self) -> bool:
        """Every line has its row (the output can be put in input order)."""
        return not (self.aborted or self.interrupted)

    @property
    def exit_code(self) -> int:
        """0 finished; 1 stopped by an error; 75 finished with transient failures; 130 interrupted."""
        if self.aborted:
            return 1
        if self.interrupted:
            return 130
        return 75 if self.transient else 0

    def line(self, output: Path, errors: Path | None = None) -> str:
        done = f"{self.processed} processed: {self.ok} ok, {self.errors} errors, {self.transient} transient"
        where = f"{output}" + (f" (failed lines: {errors})" if errors is not None else "")
        parts = [f"batch {self.task}: {self.inputs} inputs, {self.skipped} already done; {done}",
                 f"in {self.elapsed_s:.1f} s ({self.rate:.2f} img/s) -> {where}"]
        prior = self.prior
        if prior.kept or prior.dropped or prior.torn:
            resumed = f"resumed: kept {prior.ok} ok and {prior.errors} error rows, ran {prior.retrying} again"
            if prior.torn:
                resumed += ", dropped a torn last line"
            if prior.orphan_shards:
                resumed += f", deleted {len(prior.orphan_shards)} orphan shard(s)"
            parts.append(resumed)
        if self.transient:
            parts.append("rerun with --resume to retry the transient failures")
        if self.interrupted:
            parts.append("interrupted (rows in completion order until it finishes): rerun with --resume to finish")
        if self.aborted:
            parts.append(f"stopped: {self.aborted}")
        return "; ".join(parts)


@dataclass
class RunOptions:
    concurrency: int = 4
    retries: int = 2  # extra attempts for a transient failure within this run
    backoff_s: float = 0.5  # first retry delay; doubles
    max_consecutive_transient: int | None = None  # default max(10, 4 * concurrency)
    shard_bytes: int = 256 << 20
    shard_age_s: float = 30.0
    fsync_every_s: float = 2.0
    log_every_s: float = 10.0
    tty: bool | None = None  # progress bar: None = when stderr is a terminal
    handle_sigint: bool = True


class Recorder:
    """Writes finished lines (rows, embedding shards), counts them and shows progress. Shared by
    the asyncio runner and the Ray driver, so both write the same rows the same way."""

    def __init__(self, summary: Summary, output: Path, pending: int, options: RunOptions,
                 on_abort: Callable[[], None] = lambda: None) -> None:
        self.summary = summary
        self.options = options
        self.on_abort = on_abort
        self.limit = options.max_consecutive_transient or max(10, 4 * options.concurrency)
        self.writer = RowWriter(output, options.fsync_every_s)
        self.shards = ShardWriter(output, self.writer.write, max_bytes=options.shard_bytes,
                                  max_age_s=options.shard_age_s)
        self.progress = Progress(pending, tty=options.tty, log_every_s=options.log_every_s,
                                 label=f"batch {summary.task}")
        self._consecutive_transient = 0

    def record(self, row: dict[str, Any], embedding: np.ndarray | None = None) -> None:
        """`embedding`: the rows of an embedding line, for its shard."""
        summary = self.summary
        ok = is_ok(row)
        if ok:
            summary.ok += 1
            self._consecutive_transient = 0
        elif is_transient(row):
            summary.transient += 1
            self._consecutive_transient += 1
            if self._consecutive_transient >= self.limit and not summary.aborted:
                summary.aborted = (f"{self._consecutive_transient} transient failures in a row "
                                   f"(last: {error_message(row)}); fix the cause, then rerun with --resume")
                self.on_abort()
        else:
            summary.errors += 1
            self._consecutive_transient = 0
        if embedding is not None:
            self.shards.add(row["custom_id"], embedding, row)
        else:
            self.writer.write([row])
        self.progress.update(ok)

    def close(self) -> None:
        """Write buffered embeddings (their rows go out only with their shard), fsync, end progress."""
        try:
            self.shards.flush()
        finally:
            self.writer.close()
            self.progress.close()


class JobStopped(Exception):
    """A failure that stops the whole job (no row: a resume runs the line again)."""


class ItemRunner:
    """One input line -> its row (and embedding rows): check the request, fetch its images, ask
    the backend, classify failures. The local runner and the Ray engine's actors both use it, so
    every engine writes the same rows. `base_dir`: where relative image paths are read from."""

    def __init__(self, spec: JobSpec, backend: Backend, options: RunOptions, base_dir: Path,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.spec = spec
        self.backend = backend
        self.options = options
        self.stopping = stopping
        self.fetcher = MediaFetcher(backend.limits.max_bytes, allow_remote=spec.allow_remote_images,
                                    base_dir=base_dir, allowed_domains=spec.allowed_media_domains,
                                    timeout_s=spec.media_fetch_timeout_s, concurrency=spec.max_media_fetches)

    async def process(self, item: Item) -> tuple[dict[str, Any], np.ndarray | None]:
        """Raises only for a bug (an exception with no kind in the taxonomy)."""
        opts = self.options
        start = time.monotonic()
        for attempt in range(opts.retries + 1):
            try:
                return await self._attempt(item, start)
            except Exception as exc:
                failure = classify(exc)
                if failure is None:
                    raise
                if failure.rule.stops:
                    raise JobStopped(failure.message) from None
                if not failure.rule.retry or attempt == opts.retries or self.stopping():
                    if item.numbered:
                        failure = Failure(failure.kind, f"line {item.line}: {failure.message}")
                    return error_row(item.custom_id, item.line, failure,
                                     {"total_ms": _ms(time.monotonic() - start)}), None
                await asyncio.sleep(opts.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _check_model(self, model: str | None) -> None:
        if not self.spec.ignore_model and not self.backend.serves(model):
            raise NotFound(f"model {model!r} is not served here (this job runs {self.backend.model_name!r}); "
                             "pass --ignore-model to run every line on it")

    async def _attempt(self, item: Item, start: float) -> tuple[dict[str, Any], np.ndarray | None]:
        backend = self.backend
        if self.spec.task == "embed":
            model, part = embedding_request(item)
            self._check_model(model)
            image = await self.fetcher.fetch(part)
            read = time.monotonic()
            embedding = await backend.embed(image)
            body = embedding_body(model=backend.model_name, key=item.custom_id, shape=list(embedding.rows.shape),
                                  dtype=EMBED_DTYPE, grid_thw=list(embedding.grid_thw),
                                  num_tokens=embedding.num_tokens)
            return ok_row(item.custom_id, item.line, body, _timings(start, read)), embedding.rows
        request = chat_request(item, self.spec.task, self.spec.effective_max_new_tokens)
        self._check_model(request.model)
        data = await self.fetcher.fetch_all(request.media)
        read = time.monotonic()
        media = [ref.input(item_bytes) for ref, item_bytes in zip(request.media, data, strict=True)]
        reply = await backend.generate(request.chat, media, request.params)
        body = completion(reply, model=backend.model_name, request_id=new_id())
        return ok_row(item.custom_id, item.line, body, _timings(start, read)), None


def _timings(start: float, read: float) -> dict[str, float]:
    done = time.monotonic()
    return {"read_ms": _ms(read - start), "model_ms": _ms(done - read), "total_ms": _ms(done - start)}


class Job:
    """One run of a batch job on one backend. `run()` returns the `Summary`. `items` are read as the
    workers take them; `base_dir`: where relative image paths are read from (`inputs.base_dir`);
    `errors`: the `--errors` file."""

    def __init__(self, spec: JobSpec, items: Inputs, output: Path, backend: Backend, *, resume: bool,
                 base_dir: Path, errors: Path | None = None, options: RunOptions | None = None) -> None:
        self.spec = spec
        self.items = items
        self.output = Path(output)
        self.errors = None if errors is None else Path(errors)
        self.backend = backend
        self.resume = resume
        self.base_dir = base_dir
        self.options = options or RunOptions()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.bug: BaseException | None = None  # the exception that stopped the job, if a bug did

    def stop(self) -> None:
        """Stop taking lines and cancel those in flight (they run again on resume)."""
        if not self._stop.is_set():
            self._stop.set()
            for task in self._tasks:
                task.cancel()  # a generation in flight stops at its next token

    async def run(self) -> Summary:
        opts = self.options
        fingerprint = self.spec.fingerprint(self.backend.identity, errors_name(self.output, self.errors))
        prior = prepare(self.output, fingerprint, resume=self.resume, errors=self.errors)
        summary = Summary(self.spec.task, len(self.items), prior.kept, prior=prior)
        recorder = Recorder(summary, self.output, len(self.items) - prior.kept, opts, on_abort=self.stop)
        runner = ItemRunner(self.spec, self.backend, opts, self.base_dir, stopping=self._stop.is_set)
        queue = (item for item in self.items if not prior.is_done(item.custom_id))
        start = time.monotonic()

        async def worker() -> None:
            item = None
            try:
                while not self._stop.is_set():
                    item = next(queue, None)
                    if item is None:
                        return
                    row, embedding = await runner.process(item)
                    recorder.record(row, embedding)
            except InputError as exc:  # the input changed under the job (it was read through at the start)
                summary.aborted = summary.aborted or str(exc)
                self.stop()
            except JobStopped as exc:
                summary.aborted = summary.aborted or f"{exc}; fix it, then rerun with --resume"
                self.stop()
            except Exception as exc:  # a bug: stop the whole job, not just this worker
                if self.bug is None:
                    self.bug = exc
                    where = f" on {item.custom_id!r}" if item is not None else ""
                    summary.aborted = f"internal error{where}: {type(exc).__name__}: {exc}"
                self.stop()

        loop = asyncio.get_running_loop()
        on_sigint = opts.handle_sigint and _install_sigint(loop, self.stop)
        try:
            self._tasks = [asyncio.create_task(worker()) for _ in range(max(1, opts.concurrency))]
            await asyncio.gather(*self._tasks, return_exceptions=True)
            summary.interrupted = self._stop.is_set() and not summary.aborted
        finally:
            if on_sigint:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(signal.SIGINT)
            recorder.close()
            summary.elapsed_s = time.monotonic() - start
        if summary.complete:
            await loop.run_in_executor(None, finish, self.output, self.errors)
        return summary


def _install_sigint(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> bool:
    """First Ctrl-C: a clean stop. The handler is removed then, so a second one interrupts hard."""

    def handler() -> None:
        loop.remove_signal_handler(signal.SIGINT)
        stop()

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
        loop.add_signal_handler(signal.SIGINT, handler)
        return True
    return False
