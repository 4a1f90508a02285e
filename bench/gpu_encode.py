"""Benchmark: 12 MP JPEG bytes -> projector rows on one card, through a real encoder pool, with the
float patches built on the device and on the host, side by side in one run.

    python -m bench.gpu_encode [--device cuda:0] [--images 4] [--repeats 2]
    python -m bench.gpu_encode --device cpu --preset tiny --max-tokens 256 --images 2 --repeats 1  # smoke, no GPU

The k3 tower + projector get seeded random bf16 weights (built on the card, written once as a
vision-only checkpoint in a temporary directory; speed does not depend on the values). First it
checks, in this process, that the patches built on the device equal the host path's bit for bit
for the 12 MP image. Then for each patchify mode one `EncoderPool` on the device takes `--images`
copies of the JPEG at once, `--repeats` times (after one warm-up image), and it prints images/s
and the CPU time (user + system, all threads, from /proc) per image of the worker and of this
process, and how far the rows of the host mode are from the device mode's (same weights, same
pixels: 0 expected).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.batch import cpu_seconds
from bench.gpu_tower import build
from bench.preprocess import make_class
from service.engine import MediaInput
from service.engine.pool import EncoderPool
from vision import ImageOptions, plan_image, preprocess_image
from vision.checkpoint import write_checkpoint
from vision.encoder import PROJECTOR_PREFIX, TOWER_PREFIX
from vision.patchify import check_normalise, patchify_on_device
from vision.preprocess import patchify_normalise


def write_vision_checkpoint(directory: Path, device: torch.device, preset: str) -> Path:
    tower, projector = build(device, preset)
    tensors = {TOWER_PREFIX + k: v for k, v in tower.state_dict().items()}
    tensors |= {PROJECTOR_PREFIX + k: v for k, v in projector.state_dict().items()}
    return write_checkpoint(directory, tensors, {"vision_config": tower.config.to_json()})


def check_device_patches(data: bytes, options: ImageOptions, device: torch.device) -> None:
    check_normalise(device)
    image = preprocess_image(data, options).image
    host = torch.from_numpy(patchify_normalise(image))
    on_device = patchify_on_device(torch.from_numpy(image.copy()).to(device)).cpu()
    if not torch.equal(on_device.view(torch.int32), host.view(torch.int32)):
        raise SystemExit(f"error: patches built on {device} differ from the host path's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--preset", default="k3", help="vision preset (k3; tiny for a smoke run)")
    parser.add_argument("--images", type=int, default=4, help="images submitted at once per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, help="ImageOptions.max_tokens (default: none, 15,444 tokens)")
    args = parser.parse_args()
    options = ImageOptions(max_tokens=args.max_tokens)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device: this benchmark needs a GPU (or --device cpu --preset tiny)", file=sys.stderr)
        return 2
    data = make_class("12mp")
    plan = plan_image(data, options)
    item = MediaInput(data, options=options)
    check_device_patches(data, options, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.preset} tower + projector; 12 MP JPEG ({len(data) / 1e6:.1f} MB, "
          f"{plan.num_patches} patches, {plan.num_tokens} tokens); patches on {device} == host path: bit-identical\n")
    print("| patchify | images/s (median of runs) | worker CPU ms/image | this process CPU ms/image | "
          "rows max abs diff vs device |")
    print("|---|---|---|---|---|")
    rows: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="kimi-bench-gpu-encode-") as tmp:
        checkpoint = write_vision_checkpoint(Path(tmp) / "vision", device, args.preset)
        for patchify in ("device", "host"):
            with EncoderPool(checkpoint, [str(device)], patchify=patchify) as pool:
                rows[patchify] = pool.submit(item, plan).result()  # warm-up
                pids = [w["pid"] for w in pool.health()["workers"]]
                worker, parent = cpu_seconds(pids), time.process_time()
                rates = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    futures = [pool.submit(item, plan) for _ in range(args.images)]
                    for future in futures:
                        future.result()
                    rates.append(args.images / (time.perf_counter() - start))
                count = args.repeats * args.images
                worker_ms = 1e3 * (cpu_seconds(pids) - worker) / count
                parent_ms = 1e3 * (time.process_time() - parent) / count
            diff = (rows[patchify].float() - rows["device"].float()).abs().max().item()
            print(f"| {patchify} | {statistics.median(rates):.2f} | {worker_ms:.0f} | {parent_ms:.0f} | {diff:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
