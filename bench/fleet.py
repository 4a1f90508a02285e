"""Benchmark: an encoder fleet, each image encoded once. Real `kimi-vision serve` processes on
127.0.0.1 (`--components vision`, `--devices cpu:1`, the embedded tiny checkpoint).

    python -m bench.fleet [--copies 8] [--instances 3] [--rounds 2] [--baseline DIR]

`--copies` concurrent Embed calls of one new (cold) 1920x1080 photo-like JPEG, spread round-robin
over the instances (as vLLM's EPD proxy spreads a client's repeated image over its encoders), to
one instance and to `--instances` instances sharing one `--ec-export-dir` (the store). Each round
sends a new image. Reported per configuration, the median of its rounds: tower runs (the encoder
workers' `kimi_vision_encoder_images_total`; a tree without it: its embedding-cache misses, each of
which was an encode there), CPU seconds of every instance's processes (server and encoder workers)
spent on the round, and the wall time until the last answer. With `--baseline DIR` (a checkout of
an older commit, e.g. `git archive d79a085^ | tar -x -C DIR`: before single flight and the store)
the same configurations run on that tree, side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import photo_jpeg
from bench.serving import REPO_ROOT, Server
from service.rpc.client import VisionClient


def _counts(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kimi_vision_encoder_images_total" or (
                    s.name == "kimi_vision_embed_cache_lookups_total" and s.labels.get("result") == "miss"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _cpu_seconds(server: Server) -> float:
    total = 0.0
    for p in [server.process, *server.process.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _runs(before: dict[str, float], after: dict[str, float]) -> float:
    name = "kimi_vision_encoder_images_total"
    if name not in after:  # an older tree: every cache miss was an encode
        name = "kimi_vision_embed_cache_lookups_total"
    return after.get(name, 0.0) - before.get(name, 0.0)


def _round(servers: list[Server], image: bytes, copies: int) -> dict[str, float]:
    before = [_counts(s) for s in servers]
    cpu = [_cpu_seconds(s) for s in servers]

    def embed(i: int) -> None:
        with VisionClient(servers[i % len(servers)].target, timeout=600) as client:
            client.embed(image)

    start = time.perf_counter()
    with ThreadPoolExecutor(copies) as pool:
        list(pool.map(embed, range(copies)))
    wall = time.perf_counter() - start
    time.sleep(0.2)  # the workers' last CPU ticks land
    runs = sum(_runs(b, _counts(s)) for b, s in zip(before, servers, strict=True))
    spent = sum(_cpu_seconds(s) - c for s, c in zip(servers, cpu, strict=True))
    return {"runs": runs, "cpu": spent, "wall": wall}


def _configuration(tree: Path, instances: int, copies: int, images: list[bytes]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-store-") as store:
        flags = ["--components", "vision", "--max-concurrency", str(copies), "--ec-export-dir", store]
        servers = []
        try:
            for _ in range(instances):
                servers.append(Server(flags, tree=tree))
            rounds = [_round(servers, image, copies) for image in images]
        finally:
            for server in servers:
                server.stop()
    return {key: statistics.median(r[key] for r in rounds) for key in ("runs", "cpu", "wall")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", metavar="DIR", help="a checkout of an older commit, run side by side")
    args = parser.parse_args(argv)
    trees = [("this tree", REPO_ROOT)] + ([(f"baseline ({args.baseline})", Path(args.baseline).resolve())]
                                           if args.baseline else [])
    seed = 1000
    print(f"{args.copies} concurrent Embed calls of one cold 1920x1080 JPEG per round, {args.rounds} rounds "
          "(medians)")
    print(f"{'tree':<34} {'instances':>9} {'tower runs':>10} {'CPU s':>7} {'wall s':>7}")
    for name, tree in trees:
        for instances in (1, args.instances):
            images = [photo_jpeg(1920, 1080, seed=seed + i) for i in range(args.rounds)]
            seed += args.rounds  # every configuration's images are cold
            result = _configuration(tree, instances, args.copies, images)
            print(f"{name:<34} {instances:>9} {result['runs']:>10.0f} {result['cpu']:>7.2f} {result['wall']:>7.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
