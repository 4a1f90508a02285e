"""The server's log, written off the event loop.

`logging`'s stream handler writes on the thread that logs, which for the access log is the
server's event loop: when whoever reads the server's stderr stops reading (a full pipe, a stuck
log shipper), the write blocks and with it every request. Here records go into a bounded queue
and one daemon thread writes them. When the queue is full the record is dropped and counted, and
the writer says how many were lost once it can write again: a stuck log costs log lines, never
service.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler
from typing import TextIO

MAX_QUEUED_RECORDS = 10_000
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DroppingQueueHandler(QueueHandler):
    """A `QueueHandler` that drops (and counts) records instead of blocking or raising when full."""

    def __init__(self, records: queue.Queue) -> None:
        super().__init__(records)
        self._dropped_lock = threading.Lock()
        self._dropped = 0

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


class ServerLog:
    """Route the root logger through a bounded queue to a writer thread; `close()` flushes what it
    can within a timeout (a blocked stream must not hold up the server's exit either)."""

    def __init__(self, level: int = logging.INFO, stream: TextIO | None = None,
                 max_records: int = MAX_QUEUED_RECORDS) -> None:
        self._sink = logging.StreamHandler(stream or sys.stderr)
        self._sink.setFormatter(logging.Formatter(FORMAT))
        self._records: queue.Queue = queue.Queue(max_records)
        self.handler = DroppingQueueHandler(self._records)
        root = logging.getLogger()
        root.setLevel(level)
        root.addHandler(self.handler)
        self._thread = threading.Thread(target=self._write, name="kimi-vision-log", daemon=True)
        self._thread.start()

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
        deadline = time.monotonic() + timeout_s
        try:
            self._records.put(None, timeout=timeout_s)  # waits while the writer frees room
        except queue.Full:
            return  # the writer is stuck on a blocked stream: the daemon thread ends with the process
        self._thread.join(max(0.0, deadline - time.monotonic()))
