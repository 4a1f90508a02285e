"""Load driver: N grpc.aio clients for T seconds against a server on 127.0.0.1.

    .venv/bin/python -m bench.load --clients 24 --seconds 60 [--json OUT.json]
    .venv/bin/python -m bench.load --target 127.0.0.1:50051 --server-pid PID ...   # a running server

Without `--target` it starts `kimi-vision serve` itself (port 0, `--devices`, admission limits
and cache size from the flags below) and stops it with SIGTERM at the end.

Each client sends requests back to back, bounded by `--seconds` and `--max-requests`: a mix of
Embed, Preprocess, CountTokens and Encode over images of mixed sizes (64x48 PNG, 640x480 JPEG,
1280x720 JPEG, 4000x3000 JPEG; the encoder methods only get sizes up to --embed-max-pixels).
Every request's image bytes are unique (a counter in a comment block), so the embedding cache
never answers for the encoder; the pixels repeat, so making requests costs the driver nearly
nothing. A client that gets RESOURCE_EXHAUSTED backs off
10-50 ms, like a polite caller, and tries again with its next request.

Reports throughput, latency p50/p99 per method (OK answers), status-code counts, and the
server's RSS at start, middle and end, sampled every 0.5 s under load. Under load the RSS swings
by +-100 MB with whichever large images happen to be in flight, which would drown a leak, so the
leak check uses *settled* RSS: the run is cut into rounds (5 s each by default); after each one
the clients stop, the in-flight requests finish, and RSS is read after a one-second pause. The
drift is the mean settled RSS of the second half of the rounds over that of the first half,
after a warm-up that is not measured (120 s by default: on the 2-core dev box the settled RSS
climbs for one to two minutes, as glibc's per-thread arenas and gRPC's buffers reach their
working size, then stays flat within +-40 MB for as long as the load runs, 4 minutes measured).
The least-squares slope of settled RSS over time is reported as well. Checks (exit 1 if one fails): only OK and
RESOURCE_EXHAUSTED appear; the server answers health SERVING at the end; the drift is < 5 %
(judged for runs of 60 s or more only: shorter runs are too short for a leak to show, and their
drift is reported, not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
from PIL import Image

from service.rpc.client import AsyncVisionClient, image, user

REPO_ROOT = Path(__file__).resolve().parent.parent
METHOD_WEIGHTS = {"Embed": 0.4, "Preprocess": 0.3, "CountTokens": 0.2, "Encode": 0.1}
SIZE_WEIGHTS = {(64, 48): 0.4, (640, 480): 0.35, (1280, 720): 0.2, (4000, 3000): 0.05}
# Images the encoder runs on (Embed, Encode) are capped by --embed-max-pixels: on CPU the tower's
# attention over a 12 MP image's 61,776 patches takes minutes (115 s measured for one 4000x3000
# Embed on the shared 2-core box), so a CPU run sends those sizes to Preprocess/CountTokens only.
ENCODER_METHODS = ("Embed", "Encode")
RSS_DRIFT_LIMIT = 0.05
DRIFT_ENFORCED_FROM_S = 60.0
DEADLINE_S = 60.0


# ---------------------------------------------------------------------------------------------
# Images: one base image per size; each request gets a unique copy via a comment block


def _base_images() -> dict[tuple[int, int], bytes]:
    rng = np.random.default_rng(0)
    out = {}
    for w, h in SIZE_WEIGHTS:
        # Smooth gradients plus noise: compresses like a photo, not like random bytes.
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) % 256)], axis=-1)
        noise = rng.integers(0, 24, (h, w, 3))
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        if w * h <= 64 * 48:
            Image.fromarray(pixels).save(buf, "PNG")
        else:
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out[(w, h)] = buf.getvalue()
    return out


def unique_copy(data: bytes, serial: int) -> bytes:
    """`data` with a comment holding `serial`: same pixels, different bytes (and content hash)."""
    text = f"load-{serial}".encode()
    if data.startswith(b"\xff\xd8"):  # JPEG: a COM segment after SOI
        return data[:2] + b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text + data[2:]
    # PNG: a tEXt chunk after IHDR (8-byte signature + 25-byte IHDR chunk)
    import zlib

    body = b"Comment\x00" + text
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return data[:33] + chunk + data[33:]


# ---------------------------------------------------------------------------------------------
# Server process


class Server:
    """The server under load: one we started, or an existing one (RSS needs its pid)."""

    def __init__(self, target: str, pid: int | None, proc: subprocess.Popen | None = None) -> None:
        self.target = target
        self.process = psutil.Process(pid) if pid else None
        self.proc = proc

    @classmethod
    def start(cls, args: argparse.Namespace) -> Server:
        script = Path(sys.executable).with_name("kimi-vision")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
        command += ["serve", "--port", "0", "--devices", args.devices, "--max-concurrency", str(args.max_concurrency),
                    "--max-queue", str(args.max_queue), "--cache-mb", str(args.cache_mb)]
        log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            m = re.search(r"serving on (\S+):(\d+)", line)
            if m:
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return cls(f"{m.group(1)}:{m.group(2)}", proc.pid, proc)
            if time.monotonic() > deadline:
                break
        proc.kill()
        raise SystemExit(f"kimi-vision serve did not start (exit {proc.wait()}); see --server-log")

    def rss(self) -> tuple[int, int] | None:
        """(server process RSS, RSS of its child processes: the encoder workers)."""
        if self.process is None:
            return None
        try:
            main = self.process.memory_info().rss
            children = 0
            for child in self.process.children(recursive=True):
                try:
                    children += child.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            return main, children
        except psutil.NoSuchProcess:
            return None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class RssSampler(threading.Thread):
    def __init__(self, server: Server, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.server, self.every_s = server, every_s
        self.samples: list[tuple[float, int, int]] = []  # (t, server RSS, workers' RSS)
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            rss = self.server.rss()
            if rss is not None:
                self.samples.append((time.monotonic() - self.t0, *rss))
            self._halt.wait(self.every_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


# ---------------------------------------------------------------------------------------------
# Clients


@dataclass
class Result:
    method: str
    size: tuple[int, int]
    code: str
    seconds: float


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    serial: int = 0


async def _one(client: AsyncVisionClient, method: str, data: bytes) -> None:
    if method == "Embed":
        await client.embed(data)
    elif method == "Preprocess":
        await client.preprocess(data)
    elif method == "CountTokens":
        await client.count_tokens(data)
    else:
        await client.encode([user("Describe the picture.", image(data))])


async def _client(target: str, run: Run, images: dict, stop_at: float, max_requests: int, seed: int,
                  record: bool, embed_max_pixels: int) -> None:
    rng = random.Random(seed)
    methods, method_w = zip(*METHOD_WEIGHTS.items(), strict=True)
    sizes, size_w = zip(*SIZE_WEIGHTS.items(), strict=True)
    small = {s: w for s, w in SIZE_WEIGHTS.items() if s[0] * s[1] <= embed_max_pixels}
    encoder_sizes, encoder_w = zip(*small.items(), strict=True)
    async with AsyncVisionClient(target, timeout=DEADLINE_S) as client:
        while time.monotonic() < stop_at and len(run.results) < max_requests:
            method = rng.choices(methods, method_w)[0]
            if method in ENCODER_METHODS:
                size = rng.choices(encoder_sizes, encoder_w)[0]
            else:
                size = rng.choices(sizes, size_w)[0]
            run.serial += 1
            data = unique_copy(images[size], run.serial)
            start = time.perf_counter()
            try:
                await _one(client, method, data)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            elapsed = time.perf_counter() - start
            if record:
                run.results.append(Result(method, size, code, elapsed))
            if code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(rng.uniform(0.01, 0.05))


async def drive(target: str, clients: int, seconds: float, max_requests: int, images: dict, *,
                record: bool = True, embed_max_pixels: int = 1 << 20, run: Run | None = None) -> Run:
    """`clients` clients for `seconds`; returns when every client's last request has finished."""
    run = run if run is not None else Run()
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(_client(target, run, images, stop_at, max_requests, seed, record, embed_max_pixels)
                           for seed in range(clients)))
    return run


async def measure(server: Server, args: argparse.Namespace, images: dict
                  ) -> tuple[Run, list[tuple[float, int]], float]:
    """The measured run in rounds: (results, settled (t, RSS) after each round, seconds under load)."""
    run, settled, busy = Run(), [], 0.0
    rounds = args.rounds or max(2, round(args.seconds / 5))
    start = time.monotonic()
    for _ in range(rounds):
        t0 = time.monotonic()
        await drive(server.target, args.clients, args.seconds / rounds, args.max_requests, images, run=run,
                    embed_max_pixels=args.embed_max_pixels)
        busy += time.monotonic() - t0
        await asyncio.sleep(args.settle_seconds)
        rss = server.rss()
        if rss is not None:
            settled.append((time.monotonic() - start, rss[0]))
    return run, settled, busy


async def _health(target: str) -> str:
    async with AsyncVisionClient(target, timeout=10) as client:
        try:
            return await client.health()
        except grpc.RpcError as exc:
            return exc.code().name


# ---------------------------------------------------------------------------------------------
# Report


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarise(run: Run, samples: list[tuple[float, int, int]], settled: list[tuple[float, int]], seconds: float,
              args: argparse.Namespace, health: str) -> dict:
    results = run.results
    codes = Counter(r.code for r in results)
    ok = [r for r in results if r.code == "OK"]
    per_method = {}
    for method in METHOD_WEIGHTS:
        lat = [r.seconds * 1e3 for r in ok if r.method == method]
        per_method[method] = {"ok": len(lat), "p50_ms": _percentile(lat, 50), "p99_ms": _percentile(lat, 99),
                              "codes": dict(Counter(r.code for r in results if r.method == method))}
    all_lat = [r.seconds * 1e3 for r in ok]
    rss = [s[1] for s in samples]
    half = len(settled) // 2
    first = [r for _, r in settled[:half]]
    second = [r for _, r in settled[len(settled) - half:]]  # an odd middle round belongs to neither
    drift = (statistics.mean(second) / statistics.mean(first) - 1) if first and second else float("nan")
    slope = (statistics.linear_regression([t for t, _ in settled], [r / 2**20 for _, r in settled]).slope * 60
             if len(settled) >= 2 else float("nan"))
    unexpected = sorted(set(codes) - {"OK", "RESOURCE_EXHAUSTED"})
    checks = {
        "only_ok_or_resource_exhausted": not unexpected,
        "healthy_at_end": health == "SERVING",
        "rss_drift_under_5pct": (abs(drift) < RSS_DRIFT_LIMIT) if seconds >= DRIFT_ENFORCED_FROM_S else None,
    }
    return {
        "clients": args.clients, "seconds": seconds, "requests": len(results), "ok": len(ok),
        "throughput_rps": len(results) / seconds, "ok_rps": len(ok) / seconds,
        "p50_ms": _percentile(all_lat, 50), "p99_ms": _percentile(all_lat, 99),
        "codes": dict(codes), "unexpected_codes": unexpected, "per_method": per_method,
        "server": {"max_concurrency": args.max_concurrency, "max_queue": args.max_queue, "devices": args.devices,
                   "cache_mb": args.cache_mb},
        "rss_mib": {"start": rss[0] / 2**20 if rss else None, "middle": rss[len(rss) // 2] / 2**20 if rss else None,
                    "end": rss[-1] / 2**20 if rss else None, "max": max(rss) / 2**20 if rss else None,
                    "settled": [round(r / 2**20, 1) for _, r in settled],
                    "settled_first_half": statistics.mean(first) / 2**20 if first else None,
                    "settled_second_half": statistics.mean(second) / 2**20 if second else None,
                    "settled_slope_mib_per_min": slope,
                    "drift": drift, "samples": len(rss),
                    "timeline": [(round(t, 1), round(m / 2**20)) for t, m, _ in samples[::10]],
                    "workers_start": samples[0][2] / 2**20 if samples else None,
                    "workers_end": samples[-1][2] / 2**20 if samples else None},
        "health_at_end": health, "checks": checks,
    }


def print_report(report: dict) -> None:
    print(f"{report['clients']} clients, {report['seconds']:.0f} s: {report['requests']} requests "
          f"({report['throughput_rps']:.1f}/s), {report['ok']} OK ({report['ok_rps']:.1f}/s); "
          f"OK latency p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms")
    print("status codes:", ", ".join(f"{k} {v}" for k, v in sorted(report["codes"].items())))
    print(f"{'method':<12} {'OK':>6} {'p50 ms':>9} {'p99 ms':>9}  codes")
    for method, m in report["per_method"].items():
        print(f"{method:<12} {m['ok']:>6} {m['p50_ms']:>9.1f} {m['p99_ms']:>9.1f}  {m['codes']}")
    r = report["rss_mib"]
    if r["start"] is not None:
        print(f"server RSS MiB under load: start {r['start']:.0f}, middle {r['middle']:.0f}, end {r['end']:.0f}, "
              f"max {r['max']:.0f}; encoder workers {r['workers_start']:.0f} -> {r['workers_end']:.0f}")
    if r["settled"]:
        print(f"settled RSS MiB after each round: {r['settled']}; first half {r['settled_first_half']:.1f}, "
              f"second half {r['settled_second_half']:.1f}: drift {r['drift'] * 100:+.2f} %; "
              f"slope {r['settled_slope_mib_per_min']:+.1f} MiB/min")
    print("checks:", report["checks"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="its pid, for RSS (with --target)")
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup-seconds", type=float, default=120.0, help="load before the measured run (not counted)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop the measured run after this many")
    p.add_argument("--rounds", type=int, default=0, help="rounds of the measured run (default: one per 5 s, >= 2)")
    p.add_argument("--settle-seconds", type=float, default=1.0, help="pause after each round before reading RSS")
    p.add_argument("--embed-max-pixels", type=int, default=1 << 20,
                   help="largest image sent to Embed/Encode (default 1 MP: CPU; use 20000000 on a GPU)")
    p.add_argument("--devices", default="cpu:1", help="for the server this starts")
    p.add_argument("--max-concurrency", type=int, default=2, help="for the server this starts")
    p.add_argument("--max-queue", type=int, default=8, help="for the server this starts")
    p.add_argument("--cache-mb", type=int, default=16, help="for the server this starts (small: fills in seconds)")
    p.add_argument("--server-log", help="write the started server's log here")
    p.add_argument("--json", help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.max_requests < 1:
        p.error("--clients and --max-requests must be >= 1 and --seconds > 0")

    images = _base_images()
    server = Server(args.target, args.server_pid) if args.target else Server.start(args)
    sampler = None
    try:
        if args.warmup_seconds > 0:
            asyncio.run(drive(server.target, args.clients, args.warmup_seconds, args.max_requests, images,
                              record=False, embed_max_pixels=args.embed_max_pixels))
        sampler = RssSampler(server)
        sampler.start()
        run, settled, elapsed = asyncio.run(measure(server, args, images))
        sampler.stop()
        health = asyncio.run(_health(server.target))
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        exit_code = server.stop()
    report = summarise(run, sampler.samples, settled, elapsed, args, health)
    report["server_exit_code"] = exit_code
    print_report(report)
    if exit_code not in (None, 0):
        print(f"server exited with {exit_code}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = [k for k, v in report["checks"].items() if v is False] + (["server_exit"] if exit_code else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
