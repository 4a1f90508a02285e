"""Benchmark: the k3 MoonViT-3D tower + projector on one CUDA GPU, bf16, random weights.

    python -m bench.gpu_tower [--device cuda:0] [--repeats 10] [--tokens 1024,4096,16384] [--peak-tflops 989]

For each size, one square image of `tokens` merged tokens (1,024 -> 64x64 patches, 4,096 ->
128x128, 16,384 -> 256x256) goes through tower + projector; the time is the median of
`--repeats` CUDA-event-timed runs after warm-up. Prints patches/s, tokens/s, achieved TFLOP/s
(matmul FLOPs of the exact shapes, attention included; see `bench.tower.tower_flops`) and the
peak memory, and with `--peak-tflops` (the card's dense bf16 peak: 989 for an H100 or H200 SXM)
the share of it (target >= 50 % at 16k tokens). Weights are seeded random normals (speed does
not depend on their values), so no checkpoint is needed. Also checks the packed-vs-per-image
property on the GPU once (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bench.tower import tower_flops
from vision.config import PRESETS
from vision.projector import Projector
from vision.tower import VisionTower


def build(device: torch.device, preset: str = "k3") -> tuple[VisionTower, Projector]:
    cfg = PRESETS[preset]
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):  # allocate and fill on the GPU: 447 M randoms on the CPU take minutes
        tower, projector = VisionTower(cfg), Projector(cfg)
    with torch.no_grad():
        for module in (tower, projector):
            for name, p in module.named_parameters():
                if "norm" in name.rsplit(".", 2)[-2]:
                    p.fill_(1.0)
                else:
                    fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else 1
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) / math.sqrt(fan_in))
    return tower.to(torch.bfloat16).eval(), projector.to(torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", default="1024,4096,16384", help="comma-separated merged-token counts (squares)")
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak, for a %% of peak column")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (bench.tower measures the CPU)")
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    tower, projector = build(device)
    cfg = tower.config
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, k3 config, bf16, median of {args.repeats}")
    header = ("tokens", 7), ("grid", 9), ("patches", 8), ("ms", 8), ("patches/s", 11), ("tokens/s", 10)
    print(" ".join(f"{h:>{w}}" for h, w in header), f"{'TFLOP/s':>8} {'% peak':>7} {'peak GiB':>9}")

    @torch.inference_mode()
    def run(pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return projector(tower(pixels, grids))

    for tokens in (int(t) for t in args.tokens.split(",")):
        side = 2 * math.isqrt(tokens)
        if (side // 2) ** 2 != tokens:
            raise SystemExit(f"--tokens {tokens} is not a square number")
        grids = [(1, side, side)]
        pixels = torch.rand(side * side, 3, 14, 14, device=device, dtype=torch.bfloat16) * 2 - 1
        for _ in range(3):
            run(pixels, grids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(pixels, grids)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        s = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        tflops = tower_flops(cfg, grids) / s / 1e12
        share = f"{100 * tflops / args.peak_tflops:.1f}" if args.peak_tflops else "-"
        patches = side * side
        print(
            f"{tokens:>7} {side:>4}x{side:<4} {patches:>8} {s * 1e3:>8.2f} {patches / s:>11,.0f} "
            f"{tokens / s:>10,.0f} {tflops:>8.1f} {share:>7} {peak:>9.2f}"
        )

    # Packed == per image on the GPU as well (bf16: loose tolerance).
    a = torch.rand(64 * 64, 3, 14, 14, device=device) * 2 - 1
    b = torch.rand(28 * 36, 3, 14, 14, device=device) * 2 - 1
    packed = run(torch.cat([a, b]), [(1, 64, 64), (1, 28, 36)])
    alone = torch.cat([run(a, [(1, 64, 64)]), run(b, [(1, 28, 36)])])
    err = (packed.float() - alone.float()).abs().max().item()
    print(f"packed vs per-image max abs difference: {err:.3g}")


if __name__ == "__main__":
    main()
