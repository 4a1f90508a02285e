"""Benchmark: MXFP4 on the CPU (torch path): correctness and timings at K3 routed-expert shapes.

    .venv/bin/python -m bench.mxfp4 [--batches 1,16,64] [--repeats N]

For each K3 expert shape (w1/w3: 3584 -> 3072, w2: 3072 -> 3584) and batch, side by side in one
run, best of `--repeats`:
- `matmul` (torch path): W decoded 32 MiB of rows at a time into float32, float32 matmul;
- dequantise-then-matmul: `x @ dequantize(W, bf16).T` (a full bf16 copy of W per call);
- bf16 `torch.matmul` on a W decoded once beforehand (what an unquantised layer costs);
and the max relative difference of the torch path against dequantise-then-matmul in float32.
Also quantise and dequantise throughput for one expert weight. The machine is shared: compare
the columns of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.common import best_of
from textcore import mxfp4

# (name, out_features, in_features) of the routed experts (docs/MODEL.md §11).
SHAPES = [("w1/w3 3584->3072", 3072, 3584), ("w2 3072->3584", 3584, 3072)]




def dequantize_then_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x @ mxfp4.dequantize(packed, scale, x.dtype).T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (default 1,16,64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure, best taken (default 5)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, out_f, in_f in SHAPES:
        w = (torch.randn(out_f, in_f) * 0.02).bfloat16()
        t_quant = best_of(partial(mxfp4.quantize, w), max(1, args.repeats // 2))
        packed, scale = mxfp4.quantize(w)
        t_deq = best_of(partial(mxfp4.dequantize, packed, scale), args.repeats)
        dense = mxfp4.dequantize(packed, scale)
        mib = out_f * in_f / 2**20
        print(
            f"\n{name}: quantize {t_quant * 1e3:.1f} ms ({mib / t_quant:.0f} Mweights/s), "
            f"dequantize {t_deq * 1e3:.1f} ms ({mib / t_deq:.0f} Mweights/s); "
            f"bytes held packed {packed.numel() + scale.numel():,} vs bf16 {dense.numel() * 2:,}"
        )
        print("batch | torch path ms | dequant+matmul ms | bf16 matmul (pre-decoded) ms | max rel diff")
        for b in batches:
            x = torch.randn(b, in_f).bfloat16()
            t_torch = best_of(partial(mxfp4.matmul, x, packed, scale, backend="torch"), args.repeats)
            t_deq_mm = best_of(partial(dequantize_then_matmul, x, packed, scale), args.repeats)
            t_bf16 = best_of(partial(torch.matmul, x, dense.T), args.repeats)
            y = mxfp4.matmul(x, packed, scale, backend="torch").float()
            ref = x.float() @ dense.float().T
            rel = ((y - ref).abs().max() / ref.abs().max()).item()
            print(f"{b:5d} | {t_torch * 1e3:13.2f} | {t_deq_mm * 1e3:17.2f} | {t_bf16 * 1e3:28.2f} | {rel:.2e}")


if __name__ == "__main__":
    main()
