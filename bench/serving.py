"""Benchmark: the trunk serving generations, through a real `kimi-vision serve` on 127.0.0.1.

    python -m bench.serving prefill    [--max-num-batched-tokens 16384] [--repeats 1]
    python -m bench.serving throughput [--clients 16] [--requests 4] [--max-tokens 32]
    python -m bench.serving fairness   [--max-num-batched-tokens 512] [--streams 4] [--prompt-tokens 15000]
    python -m bench.serving admission  [--baseline DIR] [--chats 32] [--read-tokens 32] [--kv-cache-memory-gb 1]
    python -m bench.serving memory     [--baseline DIR] [--chats 16] [--read-tokens 32] [--kv-cache-memory-gb 8]
    python -m bench.serving step       [--sequences 32] [--rounds 2]

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
- admission: `--chats` concurrent streamed chats ("hi", no `max_tokens`: each may run to the model
  length, `ignore_eos`), each client reading `--read-tokens` tokens (logprobs on: one entry a
  token) and then leaving, under `--kv-cache-memory-gb` (1: four worst-case sequences of the tiny
  checkpoint at its 1,048,576-token context, 251,666,944 bytes each). Reported: the most sequences
  running at once (`kimi_vision_running_sequences`, scraped every 20 ms) and the wall time, for this
  tree and, with `--baseline DIR` (a checkout of an older commit, e.g. `git archive c9f0881 | tar -x
  -C DIR`), for that one, in the same run (target: >= 24 here).
- memory: `--chats` such chats held at once, at `--max-model-len` 32,768 and 1,048,576: the most KV
  bytes the scheduler accounts for (`kimi_vision_kv_cache_used_bytes`: blocks held; the baseline's
  `kimi_vision_kv_cache_reserved_bytes`: worst cases), the pool's storage
  (`kimi_vision_kv_cache_allocated_bytes`) and the server's RSS growth over idle (target: the two
  lengths within 1.2x here). CPU only: `torch.cuda.memory_allocated` is not measured.
- step: in this process (no server), `--sequences` greedy sequences of a tiny random trunk (the
  project's tiny tokenizer) on one torch
  thread decode together (logprobs and a stop string that never matches: every token parsed,
  detokenized and searched; each item handed to an event loop on another thread, as the engine's
  emit does), output processing on its own thread and then on the trunk's
  (`Scheduler(output_thread=False)`: the behaviour before), alternated for `--rounds`. Reported:
  the mean trunk step (`kimi_vision_trunk_step_seconds`) over steps of all `--sequences`, and the
  tokens a second.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import socket
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

    def __init__(self, flags: list[str], max_rss_bytes: int | None = None, tree: Path = REPO_ROOT) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="serving-bench-")
        command = [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--http-port", "0", "--devices",
                   "cpu:1", *flags]
        env = {**os.environ, "PYTHONPATH": str(tree)}  # the tree's own packages, whichever it is
        self.proc = subprocess.Popen(command, cwd=tree, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
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


# ---------------------------------------------------------------------------------------------
# admission and memory: chats without max_tokens, against this tree and a baseline


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gauges(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    values = {}
    for name in names:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            values[name] = float(m.group(1))
    return values


async def _chats_run(http: str, chats: int, read_tokens: int, hold: bool) -> tuple[float, int]:
    """`chats` streamed "hi" chats without max_tokens; each client reads `read_tokens` tokens, then
    (`hold`: once all have) leaves. Returns the wall time and the tokens read."""
    read = [0] * chats
    everyone = asyncio.Event()
    limits = httpx.Limits(max_connections=chats * 2, max_keepalive_connections=chats * 2)
    async with httpx.AsyncClient(base_url=http, timeout=1800, limits=limits) as client:
        async def chat(k: int) -> None:
            body = _chat("hi", stream=True, logprobs=True, ignore_eos=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        read[k] += len((choice.get("logprobs") or {}).get("content") or [])
                    if read[k] >= read_tokens:
                        if hold:  # every chat holds its sequence until all have their tokens
                            if all(n >= read_tokens for n in read):
                                everyone.set()
                            await everyone.wait()
                        break

        t0 = time.perf_counter()
        await asyncio.gather(*(chat(k) for k in range(chats)))
        return time.perf_counter() - t0, sum(read)


def _watch(metrics: str, names: tuple[str, ...], peaks: dict[str, float], server: Server, done: threading.Event,
           rss: list[int]) -> None:
    while not done.is_set():
        try:
            for name, value in _gauges(metrics, names).items():
                peaks[name] = max(peaks.get(name, 0.0), value)
            rss.append(server.rss())
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.02)


def _chats_on(tree: Path, flags: list[str], chats: int, read_tokens: int, hold: bool,
              names: tuple[str, ...]) -> dict:
    metrics_port = _free_port()
    server = Server([*flags, "--metrics-port", str(metrics_port)], tree=tree)
    peaks: dict[str, float] = {}
    rss: list[int] = []
    done = threading.Event()
    try:
        idle = server.rss()
        watcher = threading.Thread(target=_watch, args=(f"http://127.0.0.1:{metrics_port}/metrics", names, peaks,
                                                        server, done, rss), daemon=True)
        watcher.start()
        wall, read = asyncio.run(_chats_run(server.http, chats, read_tokens, hold))
        time.sleep(0.1)
        done.set()
        watcher.join()
    finally:
        server.stop()
    return {"wall": wall, "read": read, "peaks": peaks, "rss_growth": max(rss, default=idle) - idle}


def _trees(args: argparse.Namespace) -> list[tuple[str, Path]]:
    trees = [("this tree", REPO_ROOT)]
    if args.baseline:
        trees.append((f"baseline ({args.baseline})", Path(args.baseline).resolve()))
    return trees


def admission(args: argparse.Namespace) -> int:
    names = ("kimi_vision_running_sequences",)
    print(f"\n{args.chats} concurrent streamed chats (\"hi\", no max_tokens, ignore_eos), each client reads "
          f"{args.read_tokens} tokens then leaves; --kv-cache-memory-gb {args.kv_cache_memory_gb}, the tiny "
          "checkpoint's context (1,048,576)\n")
    print("| server | most sequences running at once | tokens read | wall |\n|---|---|---|---|")
    for label, tree in _trees(args):
        result = _chats_on(tree, ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)], args.chats,
                           args.read_tokens, False, names)
        print(f"| {label} | {result['peaks'].get(names[0], 0):.0f} | {result['read']:,} | {result['wall']:.1f} s |",
              flush=True)
    return 0


def memory(args: argparse.Namespace) -> int:
    held, reserved, allocated, running = ("kimi_vision_kv_cache_used_bytes", "kimi_vision_kv_cache_reserved_bytes",
                                          "kimi_vision_kv_cache_allocated_bytes", "kimi_vision_running_sequences")
    print(f"\n{args.chats} streamed chats (\"hi\", no max_tokens, ignore_eos) held at once until each has read "
          f"{args.read_tokens} tokens; --kv-cache-memory-gb {args.kv_cache_memory_gb}\n")
    print("| server | --max-model-len | most running | KV bytes held (gauge, peak) | pool allocated (gauge, peak) | "
          "RSS growth over idle (peak) |\n|---|---|---|---|---|---|")
    for label, tree in _trees(args):
        peaks = []
        for length in (32_768, 1_048_576):
            result = _chats_on(tree, ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--max-model-len",
                                      str(length)], args.chats, args.read_tokens, True,
                               (held, reserved, allocated, running))
            gauge = held if held in result["peaks"] else reserved
            peaks.append(result["peaks"].get(gauge, 0.0))
            pool = f"{result['peaks'][allocated]:,.0f}" if allocated in result["peaks"] else "-"
            print(f"| {label} | {length:,} | {result['peaks'].get(running, 0):.0f} | {peaks[-1]:,.0f} (`{gauge}`) | "
                  f"{pool} | {result['rss_growth'] / 2**20:,.1f} MiB |", flush=True)
        print(f"| {label} | 1,048,576 / 32,768 | | {peaks[1] / max(peaks[0], 1):.2f}x | | |", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# step time: output processing on and off the trunk's thread


def _step_run(model, tokenizer, allowed, sequences: int, output_thread: bool, tokens: int) -> tuple[float, float]:
    import torch

    from service.engine.inputs import Prompt
    from service.engine.scheduler import Generation, Scheduler
    from service.metrics import Metrics
    from textcore.generate import SamplingParams

    metrics = Metrics()
    scheduler = Scheduler(model, tokenizer, max_num_seqs=sequences, max_num_batched_tokens=max(512, sequences),
                          kv_cache_bytes=1 << 30, allowed_ids=allowed, metrics=metrics, output_thread=output_thread)
    counts = [0] * sequences
    ended = threading.Event()
    finished = [0]
    loop = asyncio.new_event_loop()  # the callers' loop, on a thread of its own, as in the server
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def emit_of(k: int):
        def heard(item) -> None:  # on the loop, as `Engine.generate` takes its items
            if item is None or isinstance(item, BaseException):
                finished[0] += 1
                if finished[0] == sequences:
                    ended.set()
            elif type(item.item).__name__ == "Logprobs":
                counts[k] += 1

        def emit(item) -> None:  # `Engine.generate`'s emit: hand the item to the caller's loop
            loop.call_soon_threadsafe(heard, item)
        return emit

    def sample(name: str) -> float:
        return metrics.registry.get_sample_value(f"kimi_vision_trunk_step_seconds_{name}") or 0.0

    try:
        torch.set_num_threads(1)
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, logprobs=True, top_logprobs=2,
                                stop=("never appears in this reply",))
        for k in range(sequences):
            ids = [163584, *tokenizer.encode(f"Tell me story number {k}, with details.")]
            scheduler.submit(Generation(Prompt(ids, [], thinking=False), [], params, emit_of(k)))
        while scheduler.last_batch < sequences or min(counts) < 10:
            time.sleep(0.001)
        steps0, sum0, t0, read0 = sample("count"), sample("sum"), time.perf_counter(), sum(counts)
        while max(counts) < tokens - 10:
            time.sleep(0.001)
        steps, spent, wall, read = sample("count") - steps0, sample("sum") - sum0, time.perf_counter() - t0, \
            sum(counts) - read0
        assert ended.wait(600)
    finally:
        scheduler.close()
        loop.call_soon_threadsafe(loop.stop)
    return spent / steps, read / wall


def step(args: argparse.Namespace) -> int:
    from service.engine.loading import decodable_ids
    from textcore.config import tiny
    from textcore.model import KimiLinearForCausalLM
    from textcore.tiny_vocab import write_tiny_tokenizer
    from textcore.tokenizer import Tokenizer

    model = KimiLinearForCausalLM.random(tiny(), seed=11)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        tokenizer = Tokenizer.from_pretrained(write_tiny_tokenizer(Path(tokenizer_dir)))
    allowed = decodable_ids(tokenizer, model.cfg.vocab_size)
    rows = []
    for r in range(args.rounds):
        for output_thread in (True, False):
            mean, rate = _step_run(model, tokenizer, allowed, args.sequences, output_thread, args.tokens)
            rows.append((output_thread, r + 1, mean, rate))
    print(f"\n{args.sequences} sequences decoding together (tiny random trunk, one torch thread, greedy, logprobs "
          f"with top 2, one stop string), {args.tokens} tokens each; steps while all {args.sequences} run\n")
    print("| output processing | round | mean step | tokens/s |\n|---|---|---|---|")
    for output_thread, r, mean, rate in rows:
        where = "its own thread" if output_thread else "the trunk's thread (before)"
        print(f"| {where} | {r} | {mean * 1e3:.2f} ms | {rate:,.0f} |")
    off = min(m for t, _, m, _ in rows if t)
    on = min(m for t, _, m, _ in rows if not t)
    print(f"\nbest mean step: {off * 1e3:.2f} ms off the trunk's thread vs {on * 1e3:.2f} ms on it ({on / off:.2f}x)")
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
    for name, chats, budget in (("admission", 32, 1.0), ("memory", 16, 8.0)):
        c = sub.add_parser(name)
        c.add_argument("--baseline", metavar="DIR", help="a checkout of an older commit, served side by side")
        c.add_argument("--chats", type=int, default=chats)
        c.add_argument("--read-tokens", type=int, default=32)
        c.add_argument("--kv-cache-memory-gb", type=float, default=budget)
    st = sub.add_parser("step")
    st.add_argument("--sequences", type=int, default=32)
    st.add_argument("--tokens", type=int, default=200, help="tokens each sequence decodes")
    st.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    parts = {"prefill": prefill, "throughput": throughput, "fairness": fairness, "admission": admission,
             "memory": memory, "step": step}
    return parts[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
