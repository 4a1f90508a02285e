"""The job's durable record: the output JSONL (and the `--errors` file), the fingerprint, resume,
and the input order of the finished file.

Exactly-once rests on three rules:
- a row is written only when its line is finished, as ONE `os.write` of the complete line to an
  `O_APPEND` descriptor, so rows never interleave and the only possible damage from a crash is a
  torn LAST line; while the job runs the output is this journal, in completion order;
- `--resume` first makes the journal clean: it drops a torn last line and the rows of transient
  failures (those lines run again), takes back the rows a finished run moved to the errors file,
  rewriting the output atomically (`service.files.atomic_path`), then skips every id that still
  has a row;
- the options that change results are stored beside the output (`<output>.job.json`) and a resume
  with different options is refused, so one file never mixes two jobs.

When every line has its row, `finish` rewrites the output in input order (each row's
`kimi_vision.line`), and with an errors file moves the failed rows there, as OpenAI's Batch API
splits them. It sorts by merging runs of sorted rows written beside the output, so its memory is
bounded whatever the row count, and replaces each file atomically: the errors file first, so a
crash between the two renames leaves failed rows in both files, which a resume counts once.
Resume holds no rows either: the ids it has read are 128-bit hashes (`service.batch.ids`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.batch.ids import IdTable
from service.batch.rows import is_ok, is_transient, line_of, shard_file
from service.files import atomic_path, write_atomic
from service.files import fsync_dir as _fsync_dir


class ResumeRefused(Exception):
    """The output cannot be (re)used as asked; the message says why and what to do."""


def fingerprint_path(output: Path) -> Path:
    return output.with_name(output.name + ".job.json")


def shard_dir(output: Path) -> Path:
    return output.with_name(output.name + ".embeddings")


def errors_name(output: Path, errors: Path | None) -> str | None:
    """How the fingerprint names the errors file: as seen from the output's directory."""
    return None if errors is None else os.path.relpath(os.path.abspath(errors), os.path.abspath(output.parent))


KEPT, RERUN = 1, 0  # a resume's verdict on an id it read (`Prior.ids`)


@dataclass
class Prior:
    """What an earlier run of this job left: ids not to run again and their statuses."""

    ids: IdTable = field(default_factory=IdTable)  # every id read: KEPT (has its row) or RERUN
    ok: int = 0
    errors: int = 0  # permanent errors (kept, not retried)
    retrying: int = 0  # transient errors dropped so they run again
    torn: bool = False  # a torn last line was dropped
    dropped: int = 0  # whole rows not kept (transient failures, rows whose shard is gone)
    orphan_shards: list[str] = field(default_factory=list)  # embedding shards no kept row points to
    shards: set[str] = field(default_factory=set)  # shard files the kept rows point to

    def is_done(self, custom_id: str) -> bool:
        """The id has its row: do not run it again."""
        return self.ids.get(custom_id) == KEPT

    @property
    def kept(self) -> int:
        """Rows kept: the lines done."""
        return self.ok + self.errors


def _describe_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    changes = [f"{k}: was {json.dumps(old.get(k))}, now {json.dumps(new.get(k))}" for k in keys
               if old.get(k) != new.get(k)]
    return "; ".join(changes)


def _has_rows(path: Path | None) -> bool:
    return path is not None and path.exists() and path.stat().st_size > 0


def check(output: Path, fingerprint: dict[str, Any], *, resume: bool, errors: Path | None = None) -> bool:
    """Raise `ResumeRefused` unless `output` may be used as asked; True when there is an earlier
    run to resume. Changes nothing on disk (so it can run before a model is loaded)."""
    fp_file = fingerprint_path(output)
    has_rows = _has_rows(output) or _has_rows(errors)
    if not resume:
        if has_rows:
            raise ResumeRefused(f"{output} already holds results; pass --resume to continue that job, "
                                "or choose another --output")
        if errors is not None and errors.exists():
            raise ResumeRefused(f"--errors {errors} already exists; pass --resume to continue that job, or choose "
                                "another --errors file")
        return False
    if not fp_file.exists():
        if has_rows:
            raise ResumeRefused(f"cannot resume: {output} has results but its job file {fp_file} is missing, so "
                                "there is no telling which options made them; use a new --output")
        return False  # nothing to resume: a fresh start
    try:
        stored = json.loads(fp_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ResumeRefused(f"cannot resume: cannot read the job file {fp_file}: {e}") from None
    if stored != fingerprint:
        raise ResumeRefused(f"--resume refused: this job's options differ from those that wrote {output} "
                            f"({_describe_changes(stored, fingerprint)}). Rerun with the original options, "
                            "or write to a new --output.")
    return True


def prepare(output: Path, fingerprint: dict[str, Any], *, resume: bool, errors: Path | None = None) -> Prior:
    """Make `output` ready to append to (see `check`); on a resume, clean it and return what the
    earlier runs did."""
    resuming = check(output, fingerprint, resume=resume, errors=errors)
    for path in (output, errors):
        if path is not None:  # a rewrite cut short by a crash: atomic_path's `.NAME.<pid>-<hex>.tmp`, finish's runs
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink()
    if not resuming:
        write_atomic(fingerprint_path(output), (json.dumps(fingerprint, indent=2, sort_keys=True) + "\n").encode())
        output.parent.mkdir(parents=True, exist_ok=True)
    output.touch()  # on a resume: a kill between writing the job file and creating the output leaves none
    return _compact(output, errors)  # a fresh start: this only clears shards a discarded earlier job left


def _compact(output: Path, errors: Path | None) -> Prior:
    """Read the existing rows (the output's, then the errors file's); rewrite the output without a
    torn tail and transient failures, and with the errors file's rows taken back.

    Streams the files (a job of millions of rows must not need its output in memory): one pass to
    decide, and only when something must change, a second pass writing the kept lines to a
    temporary file that replaces the output atomically (`service.files.atomic_path`). Both passes
    decide alike.
    """
    sources = [output] + ([errors] if errors is not None and errors.exists() else [])
    prior = Prior()
    for source in sources:
        _scan(source, output.parent, prior, keep=None)
    if prior.dropped or prior.torn or len(sources) > 1:
        with atomic_path(output) as tmp, open(tmp, "wb") as f:
            prior = Prior()
            for source in sources:
                _scan(source, output.parent, prior, keep=f.write)
        if len(sources) > 1:  # its rows are in the output now
            errors.unlink()
            _fsync_dir(errors.parent)
    directory = shard_dir(output)
    if directory.is_dir():
        for shard in sorted(directory.glob("shard-*.safetensors")):
            if shard.relative_to(output.parent).as_posix() not in prior.shards:
                prior.orphan_shards.append(str(shard))
                shard.unlink()
        for partial in directory.glob(".shard-*.tmp"):  # a shard cut short by a crash
            partial.unlink()
    return prior


def _scan(path: Path, root: Path, prior: Prior, keep: Callable[[bytes], Any] | None) -> None:
    """Decide line by line which rows a resume keeps (passing each kept line to `keep`); shard
    files are named relative to `root`, the output's directory."""
    bad_line = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if bad_line:
                raise ResumeRefused(f"cannot resume: line {bad_line} of {path} is not a result row; the file "
                                    "was changed by something else. Fix or remove that line.")
            if not line.endswith(b"\n"):
                prior.torn = True  # the last line, cut mid-write by a crash
                break
            try:
                row = json.loads(line)
                custom_id = row["custom_id"]
                transient = is_transient(row)
                shard = shard_file(row)
                line_of(row)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                bad_line = lineno  # tolerated only as the very last line
                continue
            if not _keeps(row, custom_id, transient, shard, root, prior):
                prior.dropped += 1
            elif keep is not None:
                keep(line)
    if bad_line:
        prior.torn = True


def _keeps(row: dict[str, Any], custom_id: str, transient: bool, shard: str | None, root: Path,
           prior: Prior) -> bool:
    # A shard is looked for once; a row's shard that is gone means computing it again.
    shard_gone = shard is not None and shard not in prior.shards and not (root / shard).is_file()
    if prior.ids.insert(custom_id, RERUN if transient or shard_gone else KEPT) is not None:
        return False  # a row a crash left in both files: counted once
    if transient or shard_gone:
        prior.retrying += 1
        return False
    if shard is not None:
        prior.shards.add(shard)
    if is_ok(row):
        prior.ok += 1
    else:
        prior.errors += 1
    return True


# `finish` sorts in runs of at most this many rows or bytes, and merges at most this many at once.
_RUN_ROWS = 1 << 15
_RUN_BYTES = 8 << 20
_FAN_IN = 128
_KEY = 20  # a run's record: the row's line (20 digits: bytes sort as numbers), a failed flag, the row


def finish(output: Path, errors: Path | None = None) -> None:
    """Every line has its row: put the output in input order and, with `errors`, move the failed
    rows there (also in input order). Nothing is written when the output is in order already
    and there is no errors file to write (a read-only pass finds that first).

    An external merge sort, so memory stays bounded however many rows: runs of sorted rows
    written beside the output (`.OUT.<pid>.run-N.tmp`, cleared by `prepare` if a crash leaves
    them), merged by line into the temporary files that replace the outputs (`atomic_path`)."""
    if errors is None and _in_order(output):
        return
    runs: list[Path] = []
    try:
        chunk: list[bytes] = []
        size = 0
        with open(output, "rb") as f:
            for raw in f:
                row = json.loads(raw)
                line = line_of(row)
                chunk.append(b"%020d%d" % (line, not is_ok(row)) + raw)
                size += len(raw)
                if len(chunk) >= _RUN_ROWS or size >= _RUN_BYTES:
                    runs.append(_write_run(output, len(runs), sorted(chunk, key=_line_key)))
                    chunk, size = [], 0
        if chunk:
            runs.append(_write_run(output, len(runs), sorted(chunk, key=_line_key)))
        del chunk
        names = itertools.count(len(runs))
        while len(runs) > _FAN_IN:  # at most _FAN_IN files open at once
            merged = []
            for i in range(0, len(runs), _FAN_IN):
                group = runs[i:i + _FAN_IN]
                merged.append(_write_run(output, next(names), _merged(group)))
                for run in group:
                    run.unlink()
            runs = merged
        # The errors file's block is the inner one, so it is replaced first: the failed rows are
        # safe before they leave the output.
        with atomic_path(output) as kept, open(kept, "wb") as ok_file, \
                (contextlib.nullcontext() if errors is None else atomic_path(errors)) as failures, \
                (contextlib.nullcontext() if failures is None else open(failures, "wb")) as failed_file:
            for record in _merged(runs):
                failed = failed_file is not None and record[_KEY] == ord("1")
                (failed_file if failed else ok_file).write(memoryview(record)[_KEY + 1:])
    finally:
        for run in runs:
            run.unlink(missing_ok=True)


def _in_order(output: Path) -> bool:
    """The rows are in input order already (a read-only pass: a resumed finished job, an in-order run)."""
    last = 0
    with open(output, "rb") as f:
        for raw in f:
            line = line_of(json.loads(raw))
            if line < last:
                return False
            last = line
    return True


def _line_key(record: bytes) -> bytes:
    return record[:_KEY]


def _write_run(output: Path, number: int, records: Iterable[bytes]) -> Path:
    path = output.with_name(f".{output.name}.{os.getpid()}.run-{number}.tmp")
    with open(path, "wb") as f:
        f.writelines(records)
    return path


def _merged(runs: list[Path]) -> Iterator[bytes]:
    """The runs' records in line order (equal lines in run order: the rows' order in the output)."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(run, "rb")) for run in runs]
        yield from heapq.merge(*files, key=_line_key)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class RowWriter:
    """Appends complete JSON lines to the output; fsyncs at most every `fsync_every_s` seconds
    (and on close), so a power loss costs at most that much work, never a torn line mid-file."""

    def __init__(self, output: Path, fsync_every_s: float = 2.0) -> None:
        self.output = output
        self.fsync_every_s = fsync_every_s
        self._fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_sync = time.monotonic()
        self.rows = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append `rows`; each line is whole (one write per call, lines never split across calls)."""
        if not rows:
            return
        data = b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for r in rows)
        _write_all(self._fd, data)  # one os.write unless the kernel returns short (then only on a crash)
        self.rows += len(rows)
        if time.monotonic() - self._last_sync >= self.fsync_every_s:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1
