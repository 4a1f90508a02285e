"""The server's log, written off the event loop.

`logging`'s stream handler writes on the thread that logs, which for the access log is the
server's event loop: when whoever reads the server's stderr stops reading (a full pipe, a stuck
log shipper), the write blocks and with it every request. Here records go into a bounded queue
and one daemon thread writes them. When the queue is full the record is dropped and counted, and
the writer says how many were lost once it can write again: a stuck log costs log lines, never
service.

Two formats (`--log-format`): text, one line per record, or JSON, one object per line with
`time`, `level`, `logger`, `message` and, on access lines, `request_id`, `method`, `peer`, `status`,
`duration_ms`, `request_bytes`, `response_bytes`. Every record logged while a request is handled
carries that request's id (`REQUEST_ID`, set by each face), so a client's `x-request-id` finds its
lines, errors included. In JSON, whatever else reaches the process's stderr or stdout (gRPC's C
core, the encoder workers, a `print`) is captured line by line as records of the logger `stderr`
or `stdout`, written to the log (stderr), and `announce` writes its line on the real stdout as a
JSON object too: every line the process writes on either stream is one JSON object.

A caller's values (a path, a header, a field) reach log lines, so neither format lets a value
start a line of its own: JSON escapes every control character, and the text format writes each
character that is not printable (CR, LF, tab, the other C0 and C1 controls, U+2028/2029, bidi and
other format characters) as its Python escape (`\\n`, `\\x1b`, `\\u2028`). A traceback is the one
thing written on more lines: each of them indented (and escaped alike), so every line that begins
at its first column is a record's own, with its time.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import queue
import re
import sys
import threading
import time
import uuid
from contextvars import ContextVar
from logging.handlers import QueueHandler
from typing import Literal, TextIO

MAX_QUEUED_RECORDS = 10_000
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LogFormat = Literal["text", "json"]
# What an access line carries besides its message (as `extra=`); JSON writes each one present.
ACCESS_FIELDS = ("request_id", "method", "peer", "status", "duration_ms", "request_bytes", "response_bytes")
MAX_REQUEST_ID_CHARS = 128
# A line of gRPC's C core (absl): "I1201 13:49:57.447992   32088 file.cc:2563] ..."; its first letter is the level.
ABSL_LINE = re.compile(r"([IWEF])\d{4} \d\d:")
ABSL_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_END_OF_CAPTURE = b"\0kimi-vision: end of stderr capture\n"

# The id of the request being handled (a context variable: each RPC and HTTP request runs in a
# task of its own, which copies the context, so concurrent requests never see each other's).
REQUEST_ID: ContextVar[str | None] = ContextVar("kimi_vision_request_id", default=None)


def request_id(given: str | None) -> str:
    """The caller's `x-request-id` when it is a plain token (1 to 128 visible ASCII characters, no
    spaces), else a new random one: an id that lands in every log line must not carry anything else."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable() and " " not in given:
        return given
    return uuid.uuid4().hex


def log_access(logger: logging.Logger, *, request_id: str, method: str, peer: str, status_name: str, status: str,
               seconds: float, request_bytes: int | None, response_bytes: int | None) -> None:
    """One access line, the same on every face: the text for people, ACCESS_FIELDS as `extra` for
    the JSON format. `status_name` is the face's word for its status ("code" for gRPC, "status"
    for HTTP); an unknown size is "?" in the text and absent from the JSON."""
    logger.info("%s peer=%s %s=%s ms=%.1f in=%s out=%s id=%s", method, peer, status_name, status, seconds * 1e3,
                "?" if request_bytes is None else request_bytes, "?" if response_bytes is None else response_bytes,
                request_id,
                extra={"request_id": request_id, "method": method, "peer": peer, "status": status,
                       "duration_ms": round(seconds * 1e3, 3), "request_bytes": request_bytes,
                       "response_bytes": response_bytes})


def escaped(text: str) -> str:
    """`text` with each character that is not printable written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _indented(text: str) -> str:
    return "\n".join("  " + escaped(line) for line in text.split("\n"))


class TextFormatter(logging.Formatter):
    """FORMAT, one line per record whatever a caller put in its message; a traceback and a stack
    follow on indented lines."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = escaped(self.formatMessage(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # kept on the record, as logging does
        for more in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if more:
                line += "\n" + _indented(more)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message or traceback are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in ACCESS_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _WithRequestId(logging.Filter):
    """Stamps the current request's id on records logged while it is handled (in the logging thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class DroppingQueueHandler(QueueHandler):
    """A `QueueHandler` that drops (and counts) records instead of blocking or raising when full."""

    def __init__(self, records: queue.Queue) -> None:
        super().__init__(records)
        self._dropped_lock = threading.Lock()
        self._dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record with its message merged now (its arguments may change once the caller goes on);
        the writer thread formats it, exception included (a queue between threads need not pickle)."""
        record = copy.copy(record)
        record.msg, record.args = record.getMessage(), None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._dropped_lock:
                self._dropped += 1

    def take_dropped(self) -> int:
        """Records dropped since the last call."""
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, 0
        return dropped


class _CapturedStream:
    """File descriptor `fd` (1 or 2) turned into a pipe whose lines become records of the logger
    `name` on `handler` (dropped, not waited for, when its queue is full); `stream` is the real
    stream, for whoever writes there on purpose."""

    def __init__(self, fd: int, name: str, level: int, handler: logging.Handler) -> None:
        (sys.stdout if fd == 1 else sys.stderr).flush()
        self._fd = fd
        self._saved = os.dup(fd)
        self.stream = open(os.dup(self._saved), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, fd)  # C libraries and child processes (which inherit it) write here now
        os.close(write_fd)
        self._name, self._level, self._handler = name, level, handler
        self._read_all = threading.Event()  # set when the end marker written by restore() is read
        self._thread = threading.Thread(target=self._read, args=(read_fd,), name=f"kimi-vision-{name}", daemon=True)
        self._thread.start()

    def _read(self, read_fd: int) -> None:
        with open(read_fd, "rb") as pipe:
            for raw in pipe:
                if raw == _END_OF_CAPTURE:
                    self._read_all.set()
                    continue
                line = raw.decode("utf-8", "replace").rstrip("\n")
                absl = ABSL_LINE.match(line)
                level = ABSL_LEVELS[absl.group(1)] if absl else self._level
                self._handler.handle(logging.LogRecord(self._name, level, "", 0, line, None, None))

    def restore(self, timeout_s: float) -> None:
        """The fd back to the real stream, once what this process wrote before is read (up to
        `timeout_s`). The pipe itself may stay open: children that inherited it (multiprocessing's
        resource tracker) hold it until they exit."""
        (sys.stdout if self._fd == 1 else sys.stderr).flush()
        os.write(self._fd, _END_OF_CAPTURE)
        self._read_all.wait(timeout_s)
        os.dup2(self._saved, self._fd)
        os.close(self._saved)


class ServerLog:
    """Route the root logger through a bounded queue to a writer thread; `close()` flushes what it
    can within a timeout (a blocked stream must not hold up the server's exit either)."""

    def __init__(self, level: int = logging.INFO, stream: TextIO | None = None,
                 max_records: int = MAX_QUEUED_RECORDS, log_format: LogFormat = "text") -> None:
        self._records: queue.Queue = queue.Queue(max_records)
        self.handler = DroppingQueueHandler(self._records)
        self.handler.addFilter(_WithRequestId())
        self._captured: tuple[_CapturedStream, ...] = ()
        if log_format == "json" and stream is None:
            self._captured = (_CapturedStream(2, "stderr", logging.WARNING, self.handler),
                              _CapturedStream(1, "stdout", logging.INFO, self.handler))
        self._stdout = self._captured[1].stream if self._captured else sys.stdout
        self._formatter = JsonFormatter() if log_format == "json" else None
        self._sink = logging.StreamHandler(stream or (self._captured[0].stream if self._captured else sys.stderr))
        self._sink.setFormatter(self._formatter or TextFormatter())
        root = logging.getLogger()
        root.setLevel(level)
        root.addHandler(self.handler)
        logging.captureWarnings(True)  # Python's warnings as records too, so a JSON log stays JSON
        self._thread = threading.Thread(target=self._write, name="kimi-vision-log", daemon=True)
        self._thread.start()

    def announce(self, message: str) -> None:
        """`message` on stdout at once, as the one line a supervisor waits for: in JSON, a record of the
        logger `kimi_vision` (the real stdout: what else reaches it is captured)."""
        if self._formatter is not None:
            message = self._formatter.format(logging.LogRecord("kimi_vision", logging.INFO, "", 0, message, None, None))
        print(message, file=self._stdout, flush=True)

    def _write(self) -> None:
        while True:
            record = self._records.get()
            dropped = self.handler.take_dropped()  # reported before the next record, or at the end
            if dropped:
                self._sink.handle(logging.LogRecord("kimi_vision.log", logging.WARNING, __file__, 0,
                                                    "dropped %d log records: the log reader fell behind",
                                                    (dropped,), None))
            if record is None:
                return
            self._sink.handle(record)

    def close(self, timeout_s: float = 2.0) -> None:
        logging.getLogger().removeHandler(self.handler)
        logging.captureWarnings(False)
        deadline = time.monotonic() + timeout_s
        for captured in self._captured:
            captured.restore(timeout_s / 4)
        try:
            self._records.put(None, timeout=timeout_s)  # waits while the writer frees room
        except queue.Full:
            return  # the writer is stuck on a blocked stream: the daemon thread ends with the process
        self._thread.join(max(0.0, deadline - time.monotonic()))
