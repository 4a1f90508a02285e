"""Progress of a batch job: a tqdm bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts finished items; `tty=None` picks the bar when `stream` is a terminal."""

    def __init__(self, total: int, *, stream: TextIO | None = None, tty: bool | None = None,
                 log_every_s: float = 10.0, label: str = "batch") -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.log_every_s = log_every_s
        self.label = label
        self.done = 0
        self.errors = 0
        self.start = time.monotonic()
        self._last_log = self.start
        is_tty = self.stream.isatty() if tty is None else tty
        self._bar = None
        if is_tty:
            self._bar = tqdm(total=total, unit="img", file=self.stream, dynamic_ncols=True, desc=label,
                             smoothing=0.1)
            self._bar.set_postfix(errors=0)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def rate(self) -> float:
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        if not ok:
            self.errors += 1
        if self._bar is not None:
            self._bar.update(1)
            if not ok:
                self._bar.set_postfix(errors=self.errors)
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            self.log_line()

    def log_line(self) -> None:
        rate = self.rate
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        print(f"{self.label}: {self.done}/{self.total} done, {rate:.2f} img/s, ETA {eta}, {self.errors} errors",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
