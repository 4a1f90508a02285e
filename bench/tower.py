"""Benchmark: MoonViT-3D tower + projector throughput on the CPU, tiny config.

    .venv/bin/python -m bench.tower [--repeats N] [--threads N] [--no-pool]

- in-process `VisionEncoder.encode` on one image of 16x16, 32x32 and 64x64 patches (64, 256 and
  1,024 tokens), and on a packed batch of four 32x32 images: patches/s and achieved GFLOP/s;
- eight 448x448 PNGs (32x32 patches each) decoded, preprocessed and encoded in-process, and the
  same bytes through an `EncoderPool` with 1 and with 2 CPU workers (submitted at once), in the
  same run, so the pool's transport overhead and the 2-worker scaling can be read side by side;
  each pool twice, with the float patches built on the host and on the device (`patchify`; here
  the device is the CPU), with the workers' CPU time per image (user + system, from /proc).

Figures are medians of `--repeats` runs (the dev machine is shared and noisy). Weights are the
deterministic tiny random checkpoint (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.batch import cpu_seconds
from vision.config import VisionConfig


def tower_flops(cfg: VisionConfig, grids: list[tuple[int, int, int]]) -> float:
    """Matmul FLOPs (2 per multiply-add) of tower + projector for these images."""
    d, q, i, t_out = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.text_hidden_size
    patch_in = 3 * cfg.patch_size**2
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        tokens = (h // 2) * (w // 2)
        per_block = 2 * n * d * 3 * q + 2 * n * q * d + 4 * n * n * q + 4 * n * d * i
        total += 2 * n * patch_in * d + cfg.vt_num_hidden_layers * per_block
        total += 2 * tokens * (4 * d) ** 2 + 2 * tokens * 4 * d * t_out
    return total


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_item(h: int, w: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (h * w, 3, 14, 14)).astype(np.float32), (1, h, w)


def random_png(w: int, h: int, seed: int = 0) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-pool", action="store_true", help="skip the pool measurements")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from service.checkpoints.make import make_checkpoint
    from vision.encoder import VisionEncoder

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(tmp + "/tiny", "tiny", seed=0)
        enc = VisionEncoder.from_checkpoint(ckpt)
        cfg = enc.config
        print(f"tiny config, float32, {args.threads} torch threads, median of {args.repeats}")
        print(f"{'case':<30} {'patches':>8} {'ms':>9} {'patches/s':>11} {'GFLOP/s':>8}")
        cases = [
            ("1 image 16x16", [random_item(16, 16)]),
            ("1 image 32x32", [random_item(32, 32)]),
            ("1 image 64x64", [random_item(64, 64)]),
            ("4 images 32x32 packed", [random_item(32, 32, s) for s in range(4)]),
        ]
        for name, items in cases:
            grids = [g for _, g in items]
            patches = sum(t * h * w for t, h, w in grids)
            s = median_seconds(lambda items=items: enc.encode(items), args.repeats)
            gflops = tower_flops(cfg, grids) / s / 1e9
            print(f"{name:<30} {patches:>8} {s * 1e3:>9.1f} {patches / s:>11,.0f} {gflops:>8.2f}")

        if args.no_pool:
            return
        from service.engine.pool import EncoderPool
        from vision import DEFAULT_OPTIONS, plan_image, preprocess_image

        batch = [random_png(448, 448, s) for s in range(8)]
        patches = 8 * 32 * 32
        plans = [plan_image(data) for data in batch]
        s = median_seconds(lambda: [enc.encode([preprocess_image(data)]) for data in batch], args.repeats)
        print(f"{'8 x 32x32 in-process':<30} {patches:>8} {s * 1e3:>9.1f} {patches / s:>11,.0f}")
        print(f"{'':<30} {'':>8} {'':>9} {'':>11} {'':>8} {'worker CPU ms/image':>20}")
        for workers in (1, 2):
            threads = max(1, args.threads // workers)
            for patchify in ("host", "device"):
                with EncoderPool(ckpt, workers=workers, threads_per_worker=threads, patchify=patchify) as pool:
                    def run(pool=pool) -> None:
                        futures = [pool.submit(data, DEFAULT_OPTIONS, plan)
                                   for data, plan in zip(batch, plans, strict=True)]
                        for future in futures:
                            future.result()

                    pids = [w["pid"] for w in pool.health()["workers"]]
                    run()  # warm-up, outside the CPU count
                    cpu = cpu_seconds(pids)
                    s = median_seconds(run, args.repeats)
                    cpu_ms = 1e3 * (cpu_seconds(pids) - cpu) / ((args.repeats + 1) * len(batch))
                name = f"8 x 32x32 pool {workers}w x {threads}t {patchify}"
                print(f"{name:<30} {patches:>8} {s * 1e3:>9.1f} {patches / s:>11,.0f} {'':>8} {cpu_ms:>20.1f}")


if __name__ == "__main__":
    main()
