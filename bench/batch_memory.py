"""Memory of a batch job against the size of its input: two `kimi-vision batch --task embed` jobs
on path lists, `--lines` and `--small` lines, side by side in one run (the real CLI, in-process
engine, the embedded default checkpoint). Each list names one small image (samples/grayscale.png,
written once) under distinct ids (`d7/../img.png`: the id keeps the `..`, the path read is
`img.png`). Both job processes' VmHWM and VmRSS (/proc/PID/status) are read `--at` seconds after
they start, while both still run (the bench fails if either has ended), then both are stopped
with Ctrl-C.

    .venv/bin/python bench/batch_memory.py [--lines 1000000] [--small 100000] [--at 25] [--tree DIR]

`--tree`: the source tree to run the CLI from (default: this one), e.g. a worktree of an earlier
commit for a before figure. Prints a Markdown table; the target is lines/small VmHWM <= 1.2x.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def status_kib(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a live process, in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0])
    return fields


def write_list(path: Path, lines: int) -> None:
    with open(path, "w") as f:
        for start in range(0, lines, 100_000):
            f.write("".join(f"d{n}/../img.png\n" for n in range(start, min(lines, start + 100_000))))


def done_so_far(log: Path) -> int:
    """Lines done by the last progress line the job logged (0 before its first)."""
    counts = re.findall(r"^batch embed: (\d+)/\d+ done", log.read_text(), re.MULTILINE)
    return int(counts[-1]) if counts else 0


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C (the job stops cleanly and closes its encoder workers); the whole group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the large list (default 1,000,000)")
    parser.add_argument("--small", type=int, default=100_000, help="lines of the small list (default 100,000)")
    parser.add_argument("--at", type=float, default=25.0, help="seconds after the start to read memory (default 25)")
    parser.add_argument("--tree", type=Path, default=REPO_ROOT, help="source tree to run (default: this one)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kimi-bench-batch-memory-"))
    procs: dict[int, subprocess.Popen] = {}
    logs = {lines: tmp / f"log-{lines}.txt" for lines in (args.lines, args.small)}
    try:
        shutil.copy(REPO_ROOT / "samples" / "grayscale.png", tmp / "img.png")
        for lines in (args.lines, args.small):
            write_list(tmp / f"list-{lines}.txt", lines)
        env = {**os.environ, "PYTHONPATH": str(args.tree)}
        start = time.monotonic()
        for lines in (args.lines, args.small):
            command = [sys.executable, "-m", "service.cli", "batch", "--task", "embed",
                       "--input", str(tmp / f"list-{lines}.txt"), "--output", str(tmp / f"out-{lines}.jsonl"),
                       "--log-every", "5"]
            with open(logs[lines], "w") as log:
                procs[lines] = subprocess.Popen(command, cwd=args.tree, env=env, stdout=subprocess.DEVNULL,
                                                stderr=log, start_new_session=True)
        time.sleep(max(0.0, args.at - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        memory = {lines: status_kib(proc.pid) for lines, proc in procs.items()}
        ended = [lines for lines, proc in procs.items() if proc.poll() is not None]
        if ended:  # read after the status, so a job that ended first cannot pass for a running one
            for lines in ended:
                print(logs[lines].read_text(), file=sys.stderr)
            raise SystemExit(f"the {ended} line job(s) ended before {elapsed:.1f} s; nothing measured")
        done = {lines: done_so_far(logs[lines]) for lines in procs}
    finally:
        for proc in procs.values():
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"\n`kimi-vision batch --task embed` on path lists, tree {args.tree}; read {elapsed:.1f} s after the start, "
          f"both jobs running; {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| lines | job process VmHWM | VmRSS | lines done by then (last progress line) |")
    print("|---|---|---|---|")
    for lines in (args.lines, args.small):
        m = memory[lines]
        print(f"| {lines:,} | {m['VmHWM'] / 1024:.0f} MiB | {m['VmRSS'] / 1024:.0f} MiB | {done[lines]:,} |")
    ratio = memory[args.lines]["VmHWM"] / memory[args.small]["VmHWM"]
    print(f"\nVmHWM {args.lines:,} / {args.small:,} lines: {ratio:.2f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()
