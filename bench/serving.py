"""Benchmark: the trunk serving generations, through a real `kimi-vision serve` on 127.0.0.1.

    python -m bench.serving prefill    [--max-num-batched-tokens 16384] [--repeats 1]
    python -m bench.serving throughput [--clients 16] [--requests 4] [--max-tokens 32]
    python -m bench.serving fairness   [--max-num-batched-tokens 512] [--streams 4] [--prompt-tokens 15000]

Every part starts its own server(s) (`--devices cpu:1`, the embedded tiny checkpoint, greedy
decoding) and stops them; the machine is shared, so compare the figures of one run.

- prefill: a 1920x1080 and a 12 MP (4000x3000) photo-like JPEG, each in a one-image chat with
  `max_tokens` 2 over the HTTP face of a fresh server. The first request embeds the image (the
  tower); the next `--repeats` (the same bytes: the embedding cache answers) are the trunk's: the
  fastest one's time. Memory: the server process's peak RSS through all of them over its idle RSS
  (the peak reset before, /proc/PID/clear_refs; the tower runs in the encoder worker, another
  process; freed memory stays with the process, so a later request's own peak would not show).
  Reported against linear scaling in the prompt tokens: (12 MP / 1080p) / (token ratio), for the
  time and for the memory (target <= 1.5). Aborts if the server and its workers together pass
  `--max-rss-gb` (8).
- throughput: `--clients` concurrent HTTP clients, each sending `--requests` chats back to back (one
  small PNG each, unique bytes, `max_tokens` 32 with `ignore_eos`, so every request decodes the
  same number of tokens), against a server with `--max-num-seqs 16` and then one with
  `--max-num-seqs 1` (one sequence at a time: the trunk before batching), alternated for `--rounds`
  rounds. Reported: requests/s, latency p50 / p99 of every round, and the ratio of each
  configuration's best round (target >= 4x requests/s, p99 no worse).
- fairness: `--streams` gRPC Generate streams (logprobs on: one event per token, timed as it
  arrives) run alone for `--baseline-seconds`, then a text-only chat of `--prompt-tokens` tokens
  (`max_tokens` 1) is sent; the streams' inter-token gaps while it is in (from its sending to its
  reply) against their gaps without it. Reported: median gap without, p50 / p99 / max with, and
  p99 with / median without (target <= 5), at the given `--max-num-batched-tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

from bench.common import photo_jpeg

REPO_ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"serving on (\S+):(\d+) \(health SERVING\)(.*)")


class Server:
    """`kimi-vision serve` in a subprocess: its ports, its RSS, an RSS watchdog."""

    def __init__(self, flags: list[str], max_rss_bytes: int | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="serving-bench-")
        command = [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--http-port", "0", "--devices",
                   "cpu:1", *flags]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        for line in self.proc.stdout:
            m = _READY.search(line)
            if m:
                http_port = re.search(r"http on \S+:(\d+)", m.group(3)).group(1)
                self.target = f"{m.group(1)}:{m.group(2)}"
                self.http = f"http://{m.group(1)}:{http_port}"
                break
        else:
            self.log.seek(0)
            raise SystemExit(f"kimi-vision serve did not start:\n{self.log.read()[-3000:]}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.process = psutil.Process(self.proc.pid)
        self.aborted = False
        if max_rss_bytes:
            threading.Thread(target=self._watch, args=(max_rss_bytes,), daemon=True).start()

    def _status(self, field: str) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

    def rss(self) -> int:
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak(self) -> int:
        return self._status("VmHWM")

    def _watch(self, limit: int) -> None:
        while self.proc.poll() is None:
            try:
                total = self.process.memory_info().rss + sum(c.memory_info().rss for c in
                                                             self.process.children(recursive=True))
            except psutil.NoSuchProcess:
                return
            if total > limit:
                self.aborted = True
                print(f"ABORT: server and workers at {total / 2**30:.1f} GiB, over {limit / 2**30:.1f}", flush=True)
                self.proc.kill()
                return
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _chat(text: str, image: bytes | None = None, mime: str = "image/jpeg", **extra) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url",
                           "image_url": {"url": f"data:{mime};base64," + base64.b64encode(image).decode()}})
    return {"messages": [{"role": "user", "content": content}], **extra}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


# ---------------------------------------------------------------------------------------------
# prefill scaling


def prefill(args: argparse.Namespace) -> int:
    rows = []
    for label, size in (("1920x1080", (1920, 1080)), ("12 MP (4000x3000)", (4000, 3000))):
        body = _chat("What is in the image?", photo_jpeg(*size), max_tokens=2)
        server = Server(["--max-num-batched-tokens", str(args.max_num_batched_tokens)], int(args.max_rss_gb * 2**30))
        try:
            with httpx.Client(base_url=server.http, timeout=1800) as client:
                idle = server.rss()
                server.reset_peak()
                t0 = time.perf_counter()
                cold = client.post("/v1/chat/completions", json=body)
                cold_s = time.perf_counter() - t0
                if server.aborted or cold.status_code != 200:
                    print(f"{label}: {cold.status_code} {cold.text[:300]}")
                    return 1
                warm_s = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    warm = client.post("/v1/chat/completions", json=body)
                    warm_s.append(time.perf_counter() - t0)
                    assert warm.status_code == 200, warm.text
                rows.append((label, warm.json()["usage"]["prompt_tokens"], cold_s, min(warm_s), server.peak() - idle,
                             idle))
        finally:
            server.stop()
    print(f"\nmax-num-batched-tokens {args.max_num_batched_tokens}; a fresh server per chat; trunk time: the fastest "
          f"of {args.repeats} requests with the image's rows cached; peak RSS: the server process's (the tower runs in "
          "the worker) over its idle RSS, through all of the chat's requests\n")
    print("| chat | prompt tokens | first request (tower + trunk) | trunk (embedding cached) | peak RSS over idle | "
          "idle RSS |\n|---|---|---|---|---|---|")
    for label, tokens, cold_s, warm_s, peak, idle in rows:
        print(f"| {label} | {tokens:,} | {cold_s:.2f} s | {warm_s:.2f} s | {peak / 2**20:,.0f} MiB | "
              f"{idle / 2**20:,.0f} MiB |")
    (_, t_small, _, s_small, m_small, _), (_, t_big, _, s_big, m_big, _) = rows
    tokens = t_big / t_small
    print(f"\n12 MP / 1080p: tokens {tokens:.2f}x; trunk time {s_big / s_small:.2f}x = {s_big / s_small / tokens:.2f}x "
          f"of linear; peak RSS over idle {m_big / m_small:.2f}x = {m_big / m_small / tokens:.2f}x of linear "
          "(target <= 1.5 for both)")
    return 0


# ---------------------------------------------------------------------------------------------
# throughput


def _small_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


async def _throughput_run(url: str, clients: int, requests: int, max_tokens: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        async def ask(seed: int) -> None:
            body = _chat("What is in the image?", _small_png(seed), mime="image/png", max_tokens=max_tokens,
                         ignore_eos=True)
            t0 = time.perf_counter()
            reply = await client.post("/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == max_tokens

        for seed in range(2):  # warm up: first-call costs off the clock
            await ask(10_000 + seed)
        latencies.clear()

        async def worker(k: int) -> None:
            for r in range(requests):
                await ask(k * requests + r)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        return time.perf_counter() - t0, latencies


def throughput(args: argparse.Namespace) -> int:
    results: dict[int, list[tuple[float, float, float, float]]] = {16: [], 1: []}
    for _ in range(args.rounds):  # alternated: a load spike on the shared machine hits both alike
        for seqs in results:
            server = Server(["--max-num-seqs", str(seqs)])
            try:
                wall, latencies = asyncio.run(_throughput_run(server.http, args.clients, args.requests,
                                                              args.max_tokens))
            finally:
                server.stop()
            results[seqs].append((len(latencies) / wall, _percentile(latencies, 50), _percentile(latencies, 99),
                                  wall))
    print(f"\n{args.clients} concurrent clients x {args.requests} requests, one 64x64 PNG each (unique), max_tokens "
          f"{args.max_tokens} (ignore_eos); {args.rounds} alternated rounds\n")
    print("| --max-num-seqs | round | requests/s | p50 latency | p99 latency | wall |\n|---|---|---|---|---|---|")
    for seqs, runs in results.items():
        for r, (rate, p50, p99, wall) in enumerate(runs, 1):
            print(f"| {seqs} | {r} | {rate:.2f} | {p50:.2f} s | {p99:.2f} s | {wall:.1f} s |")
    batched, alone = (max(runs) for runs in results.values())  # each configuration's best round
    print(f"\nrequests/s {batched[0] / alone[0]:.2f}x (target >= 4x); p99 {batched[2]:.2f} s vs {alone[2]:.2f} s "
          f"({'no worse' if batched[2] <= alone[2] else 'WORSE'})")
    return 0


# ---------------------------------------------------------------------------------------------
# fairness


def _long_text(client, tokens: int) -> tuple[str, int]:
    """A text-only chat of about `tokens` prompt tokens (counted by the server)."""
    from service.rpc.client import user

    sentence = "The quick brown fox jumps over the lazy dog while the model reads every word. "
    repeats, counted = 100, client.count_tokens(messages=[user(sentence * 100)]).num_tokens
    for _ in range(3):  # the template's tokens and the word boundaries make it not quite proportional
        repeats = max(1, round(repeats * tokens / counted))
        counted = client.count_tokens(messages=[user(sentence * repeats)]).num_tokens
    return sentence * repeats, counted


async def _fairness_run(target: str, streams: int, baseline_s: float, long_text: str) -> dict:
    from service.rpc.client import AsyncVisionClient, user

    arrivals: list[list[float]] = [[] for _ in range(streams)]
    marks: dict[str, float] = {}
    async with AsyncVisionClient(target, timeout=1800) as client:
        async def stream(k: int) -> None:
            sampling = {"logprobs": True, "ignore_eos": True}
            async for event in client.generate([user(f"Tell me story number {k}.")], max_new_tokens=8000,
                                               sampling=sampling):
                if event.WhichOneof("event") == "logprobs":
                    arrivals[k].append(time.perf_counter())
                if "stop" in marks:
                    return

        tasks = [asyncio.create_task(stream(k)) for k in range(streams)]
        await asyncio.sleep(2.0)  # all running
        marks["baseline"] = time.perf_counter()
        await asyncio.sleep(baseline_s)
        marks["sent"] = time.perf_counter()
        events = [e async for e in client.generate([user(long_text)], max_new_tokens=1)]
        marks["answered"] = time.perf_counter()
        marks["prompt_tokens"] = events[-1].finish.usage.prompt_tokens
        await asyncio.sleep(1.0)
        marks["stop"] = time.perf_counter()
        await asyncio.gather(*tasks, return_exceptions=True)

    def gaps(start: float, end: float) -> list[float]:
        return [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if start <= a and b <= end]

    return {"without": gaps(marks["baseline"], marks["sent"]), "with": gaps(marks["sent"], marks["answered"]),
            "prefill_s": marks["answered"] - marks["sent"], "prompt_tokens": marks["prompt_tokens"]}


def fairness(args: argparse.Namespace) -> int:
    from service.rpc.client import VisionClient

    server = Server(["--max-num-batched-tokens", str(args.max_num_batched_tokens)], int(args.max_rss_gb * 2**30))
    try:
        with VisionClient(server.target, timeout=600) as client:
            text, counted = _long_text(client, args.prompt_tokens)
        result = asyncio.run(_fairness_run(server.target, args.streams, args.baseline_seconds, text))
    finally:
        server.stop()
    without, with_ = result["without"], result["with"]
    median = statistics.median(without)
    p99 = _percentile(with_, 99)
    print(f"\n{args.streams} streams; a {result['prompt_tokens']:,}-token text prompt sent while they run, its reply "
          f"after {result['prefill_s']:.2f} s; --max-num-batched-tokens {args.max_num_batched_tokens}\n")
    print("| inter-token gaps | count | p50 | p99 | max |\n|---|---|---|---|---|")
    for label, values in (("without the long prompt", without), ("while it is in", with_)):
        p50, p99_ = (_percentile(values, q) * 1e3 for q in (50, 99))
        print(f"| {label} | {len(values)} | {p50:.1f} ms | {p99_:.1f} ms | {max(values) * 1e3:.1f} ms |")
    print(f"\np99 while it is in / median without: {p99 / median:.2f}x (target <= 5)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5, help="trunk-only requests per chat (the fastest is reported)")
    p.add_argument("--max-rss-gb", type=float, default=8.0)
    t = sub.add_parser("throughput")
    t.add_argument("--clients", type=int, default=16)
    t.add_argument("--requests", type=int, default=4, help="requests per client")
    t.add_argument("--max-tokens", type=int, default=32)
    t.add_argument("--rounds", type=int, default=2, help="alternated rounds of both configurations (best reported)")
    f = sub.add_parser("fairness")
    f.add_argument("--max-num-batched-tokens", type=int, default=512)  # the server's default
    f.add_argument("--streams", type=int, default=4)
    f.add_argument("--prompt-tokens", type=int, default=15000)
    f.add_argument("--baseline-seconds", type=float, default=8.0)
    f.add_argument("--max-rss-gb", type=float, default=8.0)
    args = parser.parse_args(argv)
    return {"prefill": prefill, "throughput": throughput, "fairness": fairness}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
