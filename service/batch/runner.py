"""The batch job: what it computes (`JobSpec`), the row it writes per item (`ItemRunner`, which
the Ray engine's actors run too), and the asyncio runner that keeps `concurrency` items in flight
on a backend.

Failures are classified by the service's one taxonomy (`service.errors`): a kind that is not
retried (bad image, bad chat, too large) is recorded as an `error` row and the job goes on; a
retried one (overloaded, unavailable, internal) is retried a few times with backoff, then recorded
with `"transient": true` (the next `--resume` runs it again). Too many transient failures in a row
(a dead server) stop the job. A bug (an exception with no kind) also stops it: writing two million
error rows for one bug helps nobody. Ctrl-C (or `stop()`) stops taking items, cancels those in
flight (they have no row, so a resume runs them), writes what is buffered and fsyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.batch.backends import Backend, Caption, Embedding
from service.batch.inputs import Item
from service.batch.journal import FORMAT, Prior, RowWriter, prepare
from service.batch.progress import Progress
from service.batch.shards import ShardWriter
from service.errors import BadRequest, classify

TASKS = ("caption", "ocr", "embed")
DEFAULT_PROMPTS = {
    "caption": "Describe this image in one short sentence.",
    "ocr": "Read all the text in this image. Reply with the text only, keeping its line breaks.",
}
DEFAULT_MAX_NEW_TOKENS = {"caption": 64, "ocr": 512}
EMBED_DTYPE = "float32"


@dataclass(frozen=True)
class JobSpec:
    """Everything that decides a job's results (besides the model and the inputs)."""

    task: str
    prompt: str | None = None  # None -> the task's default prompt
    max_new_tokens: int | None = None  # None -> the task's default

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.task == "embed" and (self.prompt is not None or self.max_new_tokens is not None):
            raise ValueError("--prompt and --max-new-tokens do not apply to --task embed")

    @property
    def effective_prompt(self) -> str | None:
        if self.task == "embed":
            return None
        return self.prompt if self.prompt is not None else DEFAULT_PROMPTS[self.task]

    @property
    def effective_max_new_tokens(self) -> int | None:
        return None if self.task == "embed" else (self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[self.task])

    def fingerprint(self, model_identity: str) -> dict[str, Any]:
        """Stored beside the output; a resume must present the same dict."""
        fp: dict[str, Any] = {"format": FORMAT, "task": self.task, "model": model_identity}
        if self.task == "embed":
            fp["embedding_dtype"] = EMBED_DTYPE
        else:
            fp.update(prompt=self.effective_prompt, max_new_tokens=self.effective_max_new_tokens,
                      sampling="greedy", thinking=False)
        return fp

    def image_chat(self, num_images: int = 1) -> list[dict[str, Any]]:
        """One user message: the image(s), then the task prompt."""
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": self.effective_prompt}]
        return [{"role": "user", "content": content}]

    def chat(self, item: Item) -> list[dict[str, Any]]:
        """The item's chat: the task prompt after its image, or a JSONL row's own messages (the task
        prompt appended to its last user message when the row carries no text at all)."""
        prompt = self.effective_prompt
        if item.messages is None:
            return self.image_chat(len(item.images))
        messages = [dict(m, content=list(m["content"])) for m in item.messages]
        has_text = any(p["type"] == "text" and p["text"].strip() for m in messages for p in m["content"])
        if not has_text:
            users = [m for m in messages if m["role"] == "user"] or messages
            users[-1]["content"].append({"type": "text", "text": prompt})
        return messages


# -- rows ----------------------------------------------------------------------------------------


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def caption_row(custom_id: str, caption: Caption, timings: dict[str, float]) -> dict[str, Any]:
    return {
        "custom_id": custom_id, "status": "ok", "text": caption.text,
        "tokens": {"prompt": caption.prompt_tokens, "image": caption.image_tokens,
                   "completion": caption.completion_tokens},
        "finish_reason": caption.finish_reason, "error": None, "timings": timings,
    }


def embed_row(custom_id: str, embedding: Embedding, timings: dict[str, float]) -> dict[str, Any]:
    """The `embedding` field (file, key, shape, dtype) is added by the shard writer."""
    return {
        "custom_id": custom_id, "status": "ok", "text": None, "tokens": {"image": embedding.num_tokens},
        "grid_thw": list(embedding.grid_thw), "error": None, "timings": timings,
    }


def error_row(custom_id: str, message: str, transient: bool, timings: dict[str, float]) -> dict[str, Any]:
    return {"custom_id": custom_id, "status": "error", "text": None, "tokens": None, "error": message,
            "transient": transient, "timings": timings}


# -- the runner ----------------------------------------------------------------------------------


@dataclass
class Summary:
    task: str
    inputs: int
    skipped: int  # done by an earlier run
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
    def exit_code(self) -> int:
        """0 finished; 1 stopped by an error; 75 finished with transient failures; 130 interrupted."""
        if self.aborted:
            return 1
        if self.interrupted:
            return 130
        return 75 if self.transient else 0

    def line(self, output: Path) -> str:
        done = f"{self.processed} processed: {self.ok} ok, {self.errors} errors, {self.transient} transient"
        parts = [f"batch {self.task}: {self.inputs} inputs, {self.skipped} already done; {done}",
                 f"in {self.elapsed_s:.1f} s ({self.rate:.2f} img/s) -> {output}"]
        prior = self.prior
        if prior.done or prior.dropped or prior.torn:
            resumed = f"resumed: kept {prior.ok} ok and {prior.errors} error rows, ran {prior.retrying} again"
            if prior.torn:
                resumed += ", dropped a torn last line"
            if prior.orphan_shards:
                resumed += f", deleted {len(prior.orphan_shards)} orphan shard(s)"
            parts.append(resumed)
        if self.transient:
            parts.append("rerun with --resume to retry the transient failures")
        if self.interrupted:
            parts.append("interrupted: rerun with --resume to finish")
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
    """Writes finished items (rows, embedding shards), counts them and shows progress. Shared by
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

    def record(self, row: dict[str, Any], embedding: Embedding | None = None) -> None:
        summary = self.summary
        if row["status"] == "ok":
            summary.ok += 1
            self._consecutive_transient = 0
        elif row["transient"]:
            summary.transient += 1
            self._consecutive_transient += 1
            if self._consecutive_transient >= self.limit and not summary.aborted:
                summary.aborted = (f"{self._consecutive_transient} transient failures in a row "
                                   f"(last: {row['error']}); fix the cause, then rerun with --resume")
                self.on_abort()
        else:
            summary.errors += 1
            self._consecutive_transient = 0
        if embedding is not None:
            self.shards.add(row["custom_id"], embedding.rows, row)
        else:
            self.writer.write([row])
        self.progress.update(row["status"] == "ok")

    def close(self) -> None:
        """Write buffered embeddings (their rows go out only with their shard), fsync, end progress."""
        try:
            self.shards.flush()
        finally:
            self.writer.close()
            self.progress.close()


class ItemRunner:
    """One item -> its row (and embedding): read its images, ask the backend, classify failures.
    The local runner and the Ray engine's actors both use it, so every engine writes the same rows."""

    def __init__(self, spec: JobSpec, backend: Backend, options: RunOptions,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.spec = spec
        self.backend = backend
        self.options = options
        self.stopping = stopping

    async def process(self, item: Item) -> tuple[dict[str, Any], Embedding | None]:
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
                retry = failure.rule.retry
                if not retry or attempt == opts.retries or self.stopping():
                    return error_row(item.custom_id, failure.message, retry,
                                     {"total_ms": _ms(time.monotonic() - start)}), None
                await asyncio.sleep(opts.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _attempt(self, item: Item, start: float) -> tuple[dict[str, Any], Embedding | None]:
        images = [ref.read() for ref in item.images]
        read = time.monotonic()
        if self.spec.task == "embed":
            if len(images) != 1:
                raise BadRequest(f"embed takes exactly one image per input; this one has {len(images)}")
            embedding = await self.backend.embed(images[0])
            done = time.monotonic()
            timings = {"read_ms": _ms(read - start), "model_ms": _ms(done - read), "total_ms": _ms(done - start)}
            return embed_row(item.custom_id, embedding, timings), embedding
        max_new = item.max_new_tokens or self.spec.effective_max_new_tokens
        caption = await self.backend.caption(self.spec.chat(item), images, max_new)
        done = time.monotonic()
        timings = {"read_ms": _ms(read - start), "model_ms": _ms(done - read), "total_ms": _ms(done - start)}
        return caption_row(item.custom_id, caption, timings), None


class Job:
    """One run of a batch job on one backend. `run()` returns the `Summary`."""

    def __init__(self, spec: JobSpec, items: Sequence[Item], output: Path, backend: Backend, *, resume: bool,
                 options: RunOptions | None = None) -> None:
        self.spec = spec
        self.items = items
        self.output = Path(output)
        self.backend = backend
        self.resume = resume
        self.options = options or RunOptions()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.bug: BaseException | None = None  # the exception that stopped the job, if a bug did

    def stop(self) -> None:
        """Stop taking items and cancel those in flight (they run again on resume)."""
        if not self._stop.is_set():
            self._stop.set()
            for task in self._tasks:
                task.cancel()  # a generation in flight stops at its next token

    async def run(self) -> Summary:
        opts = self.options
        prior = prepare(self.output, self.spec.fingerprint(self.backend.identity), resume=self.resume)
        pending = [item for item in self.items if item.custom_id not in prior.done]
        summary = Summary(self.spec.task, len(self.items), len(self.items) - len(pending), prior=prior)
        recorder = Recorder(summary, self.output, len(pending), opts, on_abort=self.stop)
        runner = ItemRunner(self.spec, self.backend, opts, stopping=self._stop.is_set)
        queue = iter(pending)
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
