"""Batch-job throughput (images/s), side by side in one run:

- embed in-process (the engine with only its vision components) with 1 vs 2 CPU encoder workers
  (target: 2 workers >= 1.7x one on 2 cores), alternating runs of the two, median of `--repeats`,
  with the CPU time the parent process and the workers spent per image (the parent competes with
  the workers for the cores); the 2-worker pool twice, with the float patches built on the host
  (the CPU default) and on the device (`patchify="device"`, what a GPU worker does; here the
  device is the CPU), so the workers' CPU time per image of the two sits side by side;
- embed through a server on 127.0.0.1 (the same checkpoint, 2 encoder workers);
- caption (greedy, --max-new-tokens) in-process and through the server.

    .venv/bin/python bench/batch.py [--images 48] [--repeats 3] [--size 640x480] [--checkpoint DIR]

Without --checkpoint it uses the embedded default (tiny random tower, MXFP4 trunk, tokenizer).
Each backend first runs a few warm-up images (pool start, first-call costs), then the
timed jobs, writing real output files as `kimi-vision batch` does. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.batch.backends import EngineBackend, ServerBackend  # noqa: E402
from service.batch.inputs import load_items  # noqa: E402
from service.batch.runner import Job, RunOptions  # noqa: E402
from service.batch.spec import JobSpec  # noqa: E402


def write_images(folder: Path, count: int, width: int, height: int) -> None:
    """Smooth random scenes as JPEGs (decode + resize + patchify work like real photos)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    for i in range(count):
        a, b, c = rng.uniform(0.005, 0.05, 3)
        img = np.stack([128 + 100 * np.sin(a * x + i), 128 + 100 * np.cos(b * y), 128 + 60 * np.sin(c * (x + y))], -1)
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        (folder / f"img{i:04d}.jpg").write_bytes(buf.getvalue())


async def timed_job(spec: JobSpec, folder: Path, out: Path, backend, concurrency: int) -> float:
    """Images/s of one job, writing its output as the CLI does (rows in the OpenAI Batch output
    shape, put in input order when the job ends)."""
    options = RunOptions(concurrency=concurrency, tty=False, handle_sigint=False, log_every_s=1e9)
    start = time.perf_counter()
    summary = await Job(spec, load_items(folder, spec), out, backend, resume=False, base_dir=folder,
                        options=options).run()
    elapsed = time.perf_counter() - start
    if summary.ok != summary.inputs:
        raise RuntimeError(f"{out.name}: {summary.line(out)}")
    return summary.ok / elapsed


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


async def warm_up(spec: JobSpec, warm: Path, out: Path, backend, concurrency: int) -> None:
    """Pool start-up and first-call costs stay out of the timed runs."""
    await timed_job(spec, warm, out, backend, concurrency)


async def main_async(args: argparse.Namespace) -> None:
    from service.checkpoints.default import default_checkpoint_dir
    from service.engine import Engine, EngineConfig
    from service.server import ServerConfig, ServerThread

    tmp = Path(tempfile.mkdtemp(prefix="kimi-bench-batch-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint_dir()
    width, height = (int(v) for v in args.size.split("x"))
    images, warm = tmp / "images", tmp / "warm"
    write_images(images, args.images, width, height)
    write_images(warm, 4, width, height)
    caption_images = tmp / "caption"
    write_images(caption_images, args.caption_images, width, height)
    embed, caption = JobSpec("embed"), JobSpec("caption", max_new_tokens=args.max_new_tokens)
    results: list[tuple[str, float]] = []

    # The pool's default gives each CPU worker cpu_count / workers torch threads, so one worker
    # runs 2 threads here; "1 worker, 1 thread" isolates the gain from the second worker itself.
    # The configurations alternate, `--repeats` times each, so all see the same background load.
    setups = {
        "1 encoder worker (default: 2 torch threads)": (1, None, "host"),
        "1 encoder worker, 1 torch thread": (1, 1, "host"),
        "2 encoder workers (default: 1 torch thread each), host-side patchify": (2, None, "host"),
        "2 encoder workers (default: 1 torch thread each), device-side patchify": (2, None, "device"),
    }
    pools = {name: EngineBackend(Engine.load(EngineConfig(checkpoint=checkpoint, devices=f"cpu:{w}",
                                                          threads_per_worker=t, patchify=patchify,
                                                          components="vision", cache_bytes=0)),
                                 owns=True)
             for name, (w, t, patchify) in setups.items()}
    rates: dict[str, list[float]] = {name: [] for name in setups}
    cpu_ms: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}  # (parent, workers) per image
    try:
        for i, (name, backend) in enumerate(pools.items()):
            await warm_up(embed, warm, tmp / f"warm-{i}.jsonl", backend, 2 * setups[name][0])
        for rep in range(args.repeats):
            for i, (name, backend) in enumerate(pools.items()):
                out = tmp / f"embed-{i}-{rep}.jsonl"
                pids = [w["pid"] for w in backend.engine.health()["workers"]]
                parent, workers = time.process_time(), cpu_seconds(pids)
                rates[name].append(await timed_job(embed, images, out, backend, 2 * setups[name][0]))
                cpu_ms[name].append((1e3 * (time.process_time() - parent) / args.images,
                                     1e3 * (cpu_seconds(pids) - workers) / args.images))
    finally:
        for backend in pools.values():
            await backend.close()
    for name in setups:
        runs = ", ".join(f"{r:.2f}" for r in rates[name])
        parent = statistics.median(p for p, _ in cpu_ms[name])
        workers = statistics.median(w for _, w in cpu_ms[name])
        results.append((f"embed, in-process, {name}; runs {runs}; CPU per image (medians): parent "
                        f"{parent:.1f} ms, workers {workers:.1f} ms", statistics.median(rates[name])))

    config = EngineConfig(checkpoint=str(checkpoint), devices="cpu:2", cache_bytes=0)
    with ServerThread(ServerConfig(port=0), config) as server:
        backend = await ServerBackend.connect(server.target)
        try:
            await warm_up(embed, warm, tmp / "warm-server.jsonl", backend, 8)
            rate = await timed_job(embed, images, tmp / "embed-server.jsonl", backend, 8)
            results.append(("embed, through the server (2 encoder workers), concurrency 8", rate))
            rate = await timed_job(caption, caption_images, tmp / "caption-server.jsonl", backend, 8)
            results.append((f"caption ({args.max_new_tokens} tokens), through the server, concurrency 8", rate))
        finally:
            await backend.close()
        local = EngineBackend(server.engine)
        rate = await timed_job(caption, caption_images, tmp / "caption-local.jsonl", local, 4)
        results.append((f"caption ({args.max_new_tokens} tokens), in-process (same engine), concurrency 4", rate))

    load = os.getloadavg()
    print(f"\n{args.images} JPEGs of {width}x{height} (embed), {args.caption_images} (caption); "
          f"{os.cpu_count()} CPUs; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| configuration | images/s (median where runs are listed) |")
    print("|---|---|")
    for name, rate in results:
        print(f"| {name} | {rate:.2f} |")
    two = results[2][1]
    print(f"\n2 workers / 1 worker (embed, in-process, medians): {two / results[0][1]:.2f}x against the default "
          f"1-worker pool, {two / results[1][1]:.2f}x against 1 worker with 1 thread (target >= 1.7x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=48, help="images per embed job (default 48)")
    parser.add_argument("--caption-images", type=int, default=12, help="images per caption job (default 12)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per worker count (default 3)")
    parser.add_argument("--size", default="640x480", help="image size WxH (default 640x480)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="caption length (default 16)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny one)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
