"""Benchmark: the gRPC service against in-process calls, and latency under concurrency.

    .venv/bin/python -m bench.service [--checkpoint DIR] [--repeats 7] [--seconds 8]

Starts `kimi-vision serve` as a subprocess on a free 127.0.0.1 port (one CPU encoder worker,
embedding cache off so every Embed runs the tower), then in one run:

1. Preprocess of a 12 MP JPEG (4000x3000, photo-like content): `vision.preprocess_image` in this
   process vs the Preprocess RPC (the server does the same work; the reply carries the sizes,
   grid, token count and prompt, not the pixels), interleaved with alternating order, min and
   median of --repeats each. Target: RPC / in-process <= 1.1. The same RPC with the uint8 model
   input returned is shown as well, and CountTokens on the same bytes (2.5 MB sent, header-only
   work): the transport cost an RPC adds, measured on its own because the machine's noise is
   larger than that cost. This process sets its allocator as the server's does
   (`service.engine.allocator.keep_freed_memory`), so both sides run the same preprocessing.
2. The encoder's part of disaggregated serving, for both engines and over both faces, the same
   1920x1080 JPEG (as a `data:` URL), interleaved, min and median of --repeats each:
   - vLLM: the request vLLM 0.33.0's proxy sends its encoder (`POST /v1/chat/completions`, the
     image with its `uuid`, no `max_tokens`) to the HTTP face in EC producer mode: embed the image,
     write its encoder-cache file (bfloat16);
   - SGLang: SGLang 0.5.23's `POST /encode` (`zmq_to_tokenizer`): embed the image and push its
     bfloat16 rows to a ZMQ PULL socket of this process, timed until the rows are received;
   - the Encode RPC with `export_vllm_ec` (bfloat16): the same work as the vLLM path, over gRPC.
   Targets: HTTP producer / Encode <= 1.15, SGLang /encode / Encode <= 1.15.
3. p50 / p99 latency and throughput at concurrency 1, 8 and 32 (asyncio clients, --seconds each)
   for Preprocess of a 1920x1080 JPEG and Embed of a 512x512 PNG.

The machine is shared and noisy: ratios come from side-by-side runs; absolute figures move.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO

import numpy as np
from PIL import Image

from bench.common import photo_jpeg


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: str | None, port: int, http_port: int, export_dir: str, log: IO[str]) -> subprocess.Popen:
    """The server writes its log (one access line per request) to `log`, a file: a pipe nobody
    reads fills after a few hundred requests and then blocks the server's event loop."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--devices", "cpu:1",
           "--cache-mb", "0", "--max-concurrency", "4", "--max-queue", "64", "--http-port", str(http_port),
           "--ec-export-dir", export_dir, "--ec-role", "producer"]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)


def wait_serving(client, proc: subprocess.Popen, log: IO[str], timeout_s: float = 600) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            if client.health(timeout=2) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become SERVING in time")


def interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """min and median seconds of each call over `repeats` interleaved rounds; the order alternates
    every round so slow drifts hit every call alike."""
    runs: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for i in range(repeats):
        for name in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            calls[name]()
            runs[name].append(time.perf_counter() - t0)
    out = {f"{name}_min": min(v) for name, v in runs.items()}
    out.update({f"{name}_median": statistics.median(v) for name, v in runs.items()})
    return out


def compare_preprocess(client, data: bytes, repeats: int) -> dict[str, float]:
    import vision
    from service.engine import EngineConfig
    from service.engine.allocator import keep_freed_memory

    keep_freed_memory(EngineConfig.keep_freed_bytes)  # the server process's allocator setting, here too
    vision.preprocess_image(data)  # warm both sides once
    client.preprocess(data)
    calls = {"local": lambda: vision.preprocess_image(data), "rpc": lambda: client.preprocess(data),
             "rpc_pixels": lambda: client.preprocess(data, return_pixels=True),
             "transport": lambda: client.count_tokens(data)}
    return interleaved(calls, repeats)


def compare_encoders(client, http_port: int, data: bytes, repeats: int) -> dict[str, float]:
    """The encoder's part of vLLM's EPD over HTTP (what its proxy sends) and over gRPC (Encode with
    the export), and of SGLang's (its /encode, the rows pushed here), interleaved."""
    import base64
    import hashlib
    import itertools

    import httpx
    import zmq

    from service.rpc.client import user

    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    image = {"type": "image_url", "image_url": {"url": url}, "uuid": hashlib.sha256(url.encode()).hexdigest()}
    body = {"model": "moonshotai/Kimi-K3", "messages": [{"role": "user", "content": [image]}], "stream": False}
    chat = [user(data, "What is in the image?")]
    context = zmq.Context()
    pull = context.socket(zmq.PULL)  # where SGLang's tokenizer takes the rows (zmq_to_tokenizer)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    requests = itertools.count()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=300) as http:
            def over_http() -> None:
                http.post("/v1/chat/completions", json=body, headers={"x-request-id": "bench"}).raise_for_status()

            def over_sglang() -> None:
                encode = {"req_id": f"bench-{next(requests)}_local_part_0", "mm_items": [url], "modality": "IMAGE",
                          "num_parts": 1, "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": port}
                http.post("/encode", json=encode).raise_for_status()
                if len(pull.recv_multipart()) != 2:
                    raise SystemExit("SGLang's /encode pushed no rows")

            calls = {"http": over_http, "sglang": over_sglang,
                     "encode": lambda: client.encode(chat, dtype="bfloat16", export_vllm_ec=True)}
            for call in calls.values():
                call()  # warm
            return interleaved(calls, repeats)
    finally:
        context.destroy(linger=0)


async def load(target: str, method: str, data: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    from service.rpc.client import AsyncVisionClient

    latencies: list[float] = []
    errors = 0
    async with AsyncVisionClient(target, timeout=300) as client:
        call = client.preprocess if method == "Preprocess" else client.embed
        await call(data)  # warm
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                try:
                    await call(data)
                except Exception:  # noqa: BLE001 - counted, reported
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
    return {"n": len(latencies), "p50": p(0.50), "p99": p(0.99), "rps": len(latencies) / elapsed, "errors": errors}


async def load_levels(target: str, cases: list[tuple[str, str, bytes]], levels: list[int], seconds: float) -> None:
    """Every level in turn, on one event loop, printing a table row each."""
    for method, label, data in cases:
        for c in levels:
            r = await load(target, method, data, c, seconds)
            print(f"| {method} | {label} | {c} | {r['n']} | {r['p50'] * 1000:.1f} | {r['p99'] * 1000:.1f} | "
                  f"{r['rps']:.1f} | {r['errors']} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrency level and RPC")
    parser.add_argument("--levels", default="1,8,32")
    args = parser.parse_args(argv)

    from service.rpc.client import VisionClient

    port, http_port = _free_port(), _free_port()
    target = f"127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")
    export_dir = tempfile.mkdtemp(prefix="kimi-bench-ec-")
    proc = start_server(args.checkpoint, port, http_port, export_dir, log)
    try:
        with VisionClient(target, timeout=300) as client:
            wait_serving(client, proc, log)
            print(f"server pid {proc.pid} on {target}; cores {os.cpu_count()}; load {os.getloadavg()[0]:.1f}")
            big = photo_jpeg(4000, 3000)
            cmp = compare_preprocess(client, big, args.repeats)
            print(f"\n12 MP JPEG ({len(big) / 1e6:.1f} MB), {args.repeats} interleaved runs each (min / median):")
            for name, label in (("local", "in-process preprocess_image  "), ("rpc", "Preprocess RPC               "),
                                ("rpc_pixels", "Preprocess RPC + uint8 pixels"),
                                ("transport", "CountTokens RPC (header only)")):
                print(f"  {label} {cmp[name + '_min'] * 1000:8.1f} / {cmp[name + '_median'] * 1000:8.1f} ms")
            print(f"  RPC / in-process: {cmp['rpc_min'] / cmp['local_min']:.3f} (min), "
                  f"{cmp['rpc_median'] / cmp['local_median']:.3f} (median); target <= 1.1")
            print(f"  (in-process + the RPC's transport cost) / in-process: "
                  f"{(cmp['local_min'] + cmp['transport_min']) / cmp['local_min']:.3f} (min), "
                  f"{(cmp['local_median'] + cmp['transport_median']) / cmp['local_median']:.3f} (median)")
            hd = photo_jpeg(1920, 1080, 2)
            epd = compare_encoders(client, http_port, hd, args.repeats)
            print(f"\nEPD encoder requests, 1920x1080 JPEG ({len(hd) / 1e6:.2f} MB), {args.repeats} interleaved "
                  "runs each (min / median):")
            for name, label in (("http", "vLLM: HTTP chat/completions (EC producer)     "),
                                ("sglang", "SGLang: /encode, rows pushed and received   "),
                                ("encode", "Encode RPC (export_vllm_ec, bfloat16)         ")):
                print(f"  {label} {epd[name + '_min'] * 1000:8.1f} / {epd[name + '_median'] * 1000:8.1f} ms")
            for name, label in (("http", "HTTP producer / Encode"), ("sglang", "SGLang /encode / Encode")):
                print(f"  {label}: {epd[name + '_min'] / epd['encode_min']:.3f} (min), "
                      f"{epd[name + '_median'] / epd['encode_median']:.3f} (median); target <= 1.15")
        cases = [("Preprocess", "1920x1080 JPEG", photo_jpeg(1920, 1080, 1)), ("Embed", "512x512 PNG", _png(512, 512))]
        print("\n| RPC | input | concurrency | requests | p50 ms | p99 ms | req/s | errors |")
        print("|---|---|---|---|---|---|---|---|")
        asyncio.run(load_levels(target, cases, [int(x) for x in args.levels.split(",")], args.seconds))
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(export_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
