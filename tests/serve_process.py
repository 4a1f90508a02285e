"""A real `kimi-vision serve` in a subprocess, for tests that need the server as its own process
(its own RSS, its own signals, its own log). Not a fixture: each test module starts what it needs.

    with ServeProcess.start(["--devices", "cpu:1"], log_path=tmp / "serve.log") as server:
        VisionClient(server.target)
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"serving on (\S+):(\d+) \(health SERVING\)(.*)")
_MORE_PORTS = re.compile(r"; (\w+) on \S+:(\d+)")  # "; http on 127.0.0.1:8000; health on ...; metrics on ..."


# The server is started through this fresh interpreter, which asks for SIGTERM when the test
# process dies, even by SIGKILL (a killed or timed-out pytest would otherwise leave a serving process
# behind; Linux's PR_SET_PDEATHSIG, kept across exec), then execs the command. Not a `preexec_fn`: that
# makes Popen fork and run Python in the child of a process whose gRPC threads are live, and gRPC's
# event engine then aborted the child before its exec (epoll_wait: Bad file descriptor; 2 of 5
# clean-clone CI runs lost test_faults' server that way).
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    f"ctypes.CDLL(None, use_errno=True).prctl(1, {int(signal.SIGTERM)}); "  # 1 = PR_SET_PDEATHSIG
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def free_port() -> int:
    """A port nothing listens on right now (for flags that take a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    """The installed `kimi-vision` script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("kimi-vision")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


class ServeProcess:
    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.process = psutil.Process(proc.pid)
        self.host = ""
        self.port = 0
        self.http_port: int | None = None  # the HTTP face's, when started with --http-port
        self.epd_port: int | None = None  # SGLang's routes' own, with --epd-port
        self.health_port: int | None = None  # the plaintext health port, with --health-port
        self.metrics_port: int | None = None  # with --metrics-port
        self._ready: list[tuple[str, int, dict[str, int]]] = []
        self.stdout_lines: list[str] = []  # everything the server wrote on stdout, as it arrives

        def read_stdout() -> None:  # keeps draining after the ready line so the pipe never fills
            for line in proc.stdout:
                self.stdout_lines.append(line.rstrip("\n"))
                m = _READY.search(line)
                if m and not self._ready:
                    more = {name: int(port) for name, port in _MORE_PORTS.findall(m.group(3))}
                    self._ready.append((m.group(1), int(m.group(2)), more))

        threading.Thread(target=read_stdout, daemon=True).start()

    @classmethod
    def launch(cls, args: list[str], *, log_path: Path, env: dict[str, str] | None = None,
               command: list[str] | None = None, cwd: Path = REPO_ROOT) -> ServeProcess:
        """Start `kimi-vision serve --port 0 <args>` without waiting for it (see `wait_ready`);
        `command`: the whole command line instead."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        log = open(log_path, "wb")  # the child writes to it for its whole life
        command = command or [*serve_command(), "serve", "--port", "0", *args]
        proc = subprocess.Popen([sys.executable, "-c", _EXEC_DYING_WITH_PARENT, *command], cwd=cwd, env=full_env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        return cls(proc, log_path)

    @classmethod
    def start(cls, args: list[str], *, log_path: Path, env: dict[str, str] | None = None,
              ready_timeout_s: float = 240.0, command: list[str] | None = None,
              cwd: Path = REPO_ROOT) -> ServeProcess:
        """Start `kimi-vision serve --port 0 <args>` and wait until it says it is serving."""
        return cls.launch(args, log_path=log_path, env=env, command=command, cwd=cwd).wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 240.0) -> ServeProcess:
        """Wait until the server says it is serving (its ports are then known)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"kimi-vision serve did not become ready (exit {self.proc.returncode}):\n"
                                   + self.log_path.read_text(errors="replace")[-4000:])
            time.sleep(0.05)
        self.host, self.port, more = self._ready[0]
        self.http_port, self.epd_port, self.health_port, self.metrics_port = (
            more.get(k) for k in ("http", "epd", "health", "metrics"))
        return self

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def rss(self) -> int:
        """Resident bytes of the server process itself (encoder workers are separate processes)."""
        return self.process.memory_info().rss

    def peak_rss(self) -> int:
        """The kernel's high-water mark of the server's resident set (VmHWM), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc status")

    def reset_peak_rss(self) -> bool:
        """Reset VmHWM to the current RSS (Linux >= 4.0; needs permission). False if not possible."""
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def encoder_workers(self) -> list[psutil.Process]:
        """The encoder pool's worker processes: the children of the pool's forkserver (the server's
        child whose command line runs multiprocessing.forkserver; not the resource tracker)."""
        servers = [p for p in self.process.children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        return [worker for server in servers for worker in server.children()]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the server drains) and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """Kill the server and any worker it left behind (only this server's own processes)."""
        children = []
        try:
            children = self.process.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        for p in [self.process, *children]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(30.0)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
