"""The job's durable record: the output JSONL, its fingerprint file, and resume.

Exactly-once rests on three rules:
- a row is written only when its item is finished, as ONE `os.write` of the complete line to an
  `O_APPEND` descriptor, so rows never interleave and the only possible damage from a crash is a
  torn LAST line;
- `--resume` first makes the file clean: it drops a torn last line and the rows of transient
  failures (those items run again) by rewriting the file atomically (temporary file, fsync,
  rename), then skips every id that still has a row;
- the options that change results are stored beside the output (`<output>.job.json`) and a resume
  with different options is refused, so one file never mixes two jobs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "kimi-vision-batch/2"  # 2: the model is named by its checkpoint fingerprint


class ResumeRefused(Exception):
    """The output cannot be (re)used as asked; the message says why and what to do."""


def fingerprint_path(output: Path) -> Path:
    return output.with_name(output.name + ".job.json")


def shard_dir(output: Path) -> Path:
    return output.with_name(output.name + ".embeddings")


@dataclass
class Prior:
    """What an earlier run of this job left: ids not to run again and their statuses."""

    done: set[str] = field(default_factory=set)
    ok: int = 0
    errors: int = 0  # permanent errors (kept, not retried)
    retrying: int = 0  # transient errors dropped so they run again
    torn: bool = False  # a torn last line was dropped
    dropped: int = 0  # whole rows not kept (transient failures, rows whose shard is gone)
    orphan_shards: list[str] = field(default_factory=list)  # embedding shards no kept row points to
    shards: set[str] = field(default_factory=set)  # shard files the kept rows point to


def _describe_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    changes = [f"{k}: was {json.dumps(old.get(k))}, now {json.dumps(new.get(k))}" for k in keys
               if old.get(k) != new.get(k)]
    return "; ".join(changes)


def check(output: Path, fingerprint: dict[str, Any], *, resume: bool) -> bool:
    """Raise `ResumeRefused` unless `output` may be used as asked; True when there is an earlier
    run to resume. Changes nothing on disk (so it can run before a model is loaded)."""
    fp_file = fingerprint_path(output)
    has_rows = output.exists() and output.stat().st_size > 0
    if not resume:
        if has_rows:
            raise ResumeRefused(f"{output} already holds results; pass --resume to continue that job, "
                                "or choose another --output")
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


def prepare(output: Path, fingerprint: dict[str, Any], *, resume: bool) -> Prior:
    """Make `output` ready to append to (see `check`); on a resume, clean it and return what the
    earlier runs did."""
    if check(output, fingerprint, resume=resume):
        output.touch()  # a kill between writing the job file and creating the output leaves none
        return _compact(output)
    _write_atomic(fingerprint_path(output), (json.dumps(fingerprint, indent=2, sort_keys=True) + "\n").encode())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.touch()
    return _compact(output)  # an empty output: this only clears shards a discarded earlier job left


def _compact(output: Path) -> Prior:
    """Read the existing rows; rewrite the file without a torn tail and transient failures.

    Streams the file (a job of millions of rows must not need its output in memory): one pass to
    decide, and only when something must go, a second pass writing the kept lines to a temporary
    file that replaces the output atomically. Both passes decide alike (same file, same shards).
    """
    prior = _scan(output, keep=None)
    if prior.dropped or prior.torn:
        tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            prior = _scan(output, keep=f.write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
        _fsync_dir(output.parent)
    directory = shard_dir(output)
    if directory.is_dir():
        for shard in sorted(directory.glob("shard-*.safetensors")):
            if shard.relative_to(output.parent).as_posix() not in prior.shards:
                prior.orphan_shards.append(str(shard))
                shard.unlink()
        for partial in directory.glob(".shard-*.tmp"):  # a shard cut short by a crash
            partial.unlink()
    return prior


def _scan(output: Path, keep: Callable[[bytes], Any] | None) -> Prior:
    """Decide line by line which rows a resume keeps (passing each kept line to `keep`)."""
    prior = Prior()
    bad_line = 0
    with open(output, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if bad_line:
                raise ResumeRefused(f"cannot resume: line {bad_line} of {output} is not a result row; the file "
                                    "was changed by something else. Fix or remove that line.")
            if not line.endswith(b"\n"):
                prior.torn = True  # the last line, cut mid-write by a crash
                break
            try:
                row = json.loads(line)
                custom_id = row["custom_id"]
            except (json.JSONDecodeError, KeyError, TypeError):
                bad_line = lineno  # tolerated only as the very last line
                continue
            if not _keeps(row, custom_id, output, prior):
                prior.dropped += 1
            elif keep is not None:
                keep(line)
    if bad_line:
        prior.torn = True
    return prior


def _keeps(row: dict[str, Any], custom_id: str, output: Path, prior: Prior) -> bool:
    if custom_id in prior.done:
        return False  # cannot happen with this writer; never count an id twice
    if row.get("status") == "error" and row.get("transient"):
        prior.retrying += 1
        return False
    embedding = row.get("embedding")
    if row.get("status") == "ok" and embedding:
        if not (output.parent / embedding["file"]).is_file():
            prior.retrying += 1  # its shard is gone: compute it again
            return False
        prior.shards.add(embedding["file"])
    prior.done.add(custom_id)
    if row.get("status") == "ok":
        prior.ok += 1
    else:
        prior.errors += 1
    return True


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
