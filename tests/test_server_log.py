"""The server's log never blocks its requests (service.logs): a log reader that stops reading
costs log lines, not service. With `--log-format json` every line the process writes, on stdout
and stderr, is one JSON object."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import subprocess
import sys
import threading

from PIL import Image
from serve_process import ServeProcess

from service.cpus import cpu_budget
from service.logs import ServerLog, log_access
from service.rpc.client import VisionClient


def _tiny_png() -> bytes:
    """28x28 grey: one 2x2 merge of 14-px patches, 1 image token."""
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (128, 128, 128)).save(buf, "PNG")
    return buf.getvalue()


def _fill(fd: int) -> None:
    """Write to a pipe until it is full, then leave its writes blocking."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(fd, b"#" * 4096)
    except BlockingIOError:
        pass
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _drain(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1 << 16):
        into += chunk


def test_a_stuck_stream_drops_and_counts_records_instead_of_blocking_the_logger():
    read_fd, write_fd = os.pipe()
    _fill(write_fd)
    stream = io.TextIOWrapper(os.fdopen(write_fd, "wb", buffering=0), write_through=True)
    root = logging.getLogger()
    level = root.level
    log = ServerLog(stream=stream, max_records=10)
    try:
        for i in range(100):  # every call returns at once although nothing can be written
            logging.getLogger("kimi_vision.test").info("record %d", i)
    finally:
        got = bytearray()
        reader = threading.Thread(target=_drain, args=(read_fd, got))
        reader.start()  # the writer can write again
        log.close(timeout_s=10)
        stream.close()
        reader.join(10)
        os.close(read_fd)
        root.setLevel(level)
    lines = got.decode().replace("#", "").splitlines()
    written = [line for line in lines if "kimi_vision.test: record" in line]
    notices = [line for line in lines if "dropped" in line]
    dropped = sum(int(line.split("dropped ")[1].split()[0]) for line in notices)
    # Each record is either written or counted in a notice, whenever the writer could write again.
    assert dropped > 0 and len(written) + dropped == 100, lines


def test_server_keeps_serving_while_nobody_reads_its_log(tmp_path):
    fifo = tmp_path / "serve.log"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: the pipe fills
    try:
        args = ["--devices", "cpu:1", "--cache-mb", "0", "--log-health-checks"]  # a line per health check
        with ServeProcess.start(args, log_path=fifo) as server:
            with VisionClient(server.target, timeout=30) as client:
                # One access-log line (~130 bytes) per call: ~200 KB, three times the pipe's size.
                for _ in range(1500):
                    assert client.health() == "SERVING"
                assert client.count_tokens(_tiny_png()).num_tokens == 1
            got = bytearray()
            os.set_blocking(reader, True)
            drain = threading.Thread(target=_drain, args=(reader, got))
            drain.start()
            assert server.terminate() == 0  # the log drains, then SIGTERM's drain exits cleanly
        drain.join(30)  # EOF once the server and its workers have exited
    finally:
        os.close(reader)
    assert got.count(b"/grpc.health.v1.Health/Check") >= 1500  # late, but every line arrived


def test_json_log_makes_every_line_of_stdout_and_stderr_json(tmp_path):
    """`serve --log-format json` as the image runs it: the banner on stdout, the start-up lines (the
    CPUs and the thread defaults they give), access lines, gRPC's own and the drain, all JSON."""
    args = ["--devices", "cpu:1", "--log-format", "json", "--health-port", "0", "--cache-mb", "0"]
    with ServeProcess.start(args, log_path=tmp_path / "serve.log") as server:
        with VisionClient(server.target, timeout=30) as client:
            assert client.health() == "SERVING"
            assert client.count_tokens(_tiny_png()).num_tokens == 1
        assert server.terminate() == 0
        stdout, stderr = list(server.stdout_lines), server.log_text().splitlines()
    records = [json.loads(line) for line in stdout + stderr]  # each line is one JSON object
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    (banner,) = [json.loads(line) for line in stdout]
    assert banner["logger"] == "kimi_vision" and "(health SERVING)" in banner["message"]
    messages = [r["message"] for r in records]
    budget = cpu_budget()
    assert f"CPUs: {budget}" in messages
    # the trunk beside one CPU worker: the CPUs it leaves (OMP_NUM_THREADS, when set, decides instead)
    trunk_threads = int(os.environ.get("OMP_NUM_THREADS", budget.trunk_threads(budget.per_worker(1))))
    assert f"trunk: cpu, {trunk_threads} torch threads in this process" in messages
    wide = [m for m in messages if m.startswith("trunk: a prompt's attention over many keys takes")]
    if "OMP_NUM_THREADS" not in os.environ and budget.usable > trunk_threads:  # the CPUs the worker leaves idle
        assert wide == [f"trunk: a prompt's attention over many keys takes {budget.usable} torch threads while "
                        "the CPU encoder workers are idle"]
    else:
        assert wide == []
    assert f"encoder workers: cpu ({budget.per_worker(1)} torch/OpenCV threads each); {max(2, budget.usable)} " \
           "request threads" in messages
    assert any("CountTokens" in m for m in messages)  # the access line


def test_json_log_captures_whatever_else_reaches_stdout(tmp_path):
    """A stray `print`, a raw write on fd 1 and a child's output become records of the logger
    `stdout` in the log (stderr); stdout itself holds only what `announce` writes, as JSON."""
    code = (
        "import os, subprocess, sys\n"
        "from service.logs import ServerLog\n"
        "log = ServerLog(log_format='json')\n"
        "print('a stray print')\n"
        "os.write(1, b'a raw write\\n')\n"
        "subprocess.run(['echo', 'a child'], check=True)\n"
        "print('to stderr', file=sys.stderr)\n"
        "log.announce('serving on here')\n"
        "log.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    (banner,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert (banner["logger"], banner["message"]) == ("kimi_vision", "serving on here")
    logged = [json.loads(line) for line in done.stderr.splitlines()]
    assert sorted((r["logger"], r["message"]) for r in logged) == [
        ("stderr", "to stderr"), ("stdout", "a child"), ("stdout", "a raw write"), ("stdout", "a stray print")]


# A value a caller chose, as a warning or an access line would log it: each character that could end
# a line (or hide what follows on a terminal) and, after a line break, what a record looks like.
HOSTILE = "a\r\n2026-01-01 00:00:00,000 INFO kimi_vision.server: forged\u2028\u2029\x1b[2K\x85\u202e\x00\tb"


def _log_through_server_log(log_format: str) -> list[str]:
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    log = ServerLog(stream=stream, log_format=log_format)
    logger = logging.getLogger("kimi_vision.test")
    try:
        logger.warning("push to %s failed", HOSTILE)
        log_access(logger, request_id="rid", method=f"POST {HOSTILE}", peer=HOSTILE, status_name="status",
                   status="400", seconds=0.001, request_bytes=1, response_bytes=2)
        try:
            raise ValueError(f"bad value {HOSTILE}")
        except ValueError:
            logger.exception("a bug")
    finally:
        log.close(timeout_s=10)
        root.setLevel(level)
    return stream.getvalue().split("\n")[:-1]  # only LF ends a line (as a terminal or `tail` reads it)


def test_the_text_log_keeps_a_callers_value_on_its_line():
    lines = _log_through_server_log("text")
    shown = r"a\r\n2026-01-01 00:00:00,000 INFO kimi_vision.server: forged\u2028\u2029\x1b[2K\x85\u202e\x00\tb"
    assert lines[0].endswith(f"WARNING kimi_vision.test: push to {shown} failed")
    assert lines[1].endswith(f"INFO kimi_vision.test: POST {shown} peer={shown} status=400 ms=1.0 in=1 out=2 id=rid")
    assert lines[2].endswith("ERROR kimi_vision.test: a bug")
    # A traceback is ours, on lines of its own, each indented: no line of it reads as a record, even
    # where an exception's message holds the caller's line break.
    traceback = lines[3:]
    assert traceback[0] == "  Traceback (most recent call last):"
    assert traceback[-2:] == [r"  ValueError: bad value a\r", "  " + shown.split(r"\n", 1)[1]]
    assert all(line.startswith("  ") for line in traceback)
    assert all(line.isprintable() for line in lines)
    assert sum(line.startswith("2026-01-01") for line in lines) == 0


def test_the_json_log_keeps_a_callers_value_intact():
    lines = _log_through_server_log("json")
    assert all(line.isascii() and line.isprintable() for line in lines)  # json escapes the rest
    warning, access, bug = (json.loads(line) for line in lines)
    assert warning["message"] == f"push to {HOSTILE} failed"
    assert (access["method"], access["peer"]) == (f"POST {HOSTILE}", HOSTILE)
    assert bug["message"] == "a bug" and bug["exception"].endswith(f"ValueError: bad value {HOSTILE}")
