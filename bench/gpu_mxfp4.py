"""GPU benchmark: the Triton MXFP4 kernels against bf16 `torch.matmul` at K3 routed-expert shapes.

    python -m bench.gpu_mxfp4 [--batches 1,2,4,...,256] [--experts 64] [--rep-ms 200]

Needs a CUDA GPU (target: H100/H200) and TRITON_INTERPRET unset. For each expert shape
(w1/w3: x[B, 3584] -> [B, 3072]; w2: x[B, 3072] -> [B, 3584]) and batch B:
1. checks `mxfp4_matmul` against dequantise-then-matmul (float32) and stops on a mismatch;
2. times, with `triton.testing.do_bench` (CUDA events; L2 flushed between runs, as an expert's
   weights are cold in a real MoE step), the Triton kernel, bf16 `torch.matmul(x, W.T)` on the
   dense weight, and dequantise-then-matmul in torch;
3. prints the speed-up over bf16 (target: >= 3x at B = 1, from reading 4.25 instead of 16 bits
   per weight).
Then the grouped expert GEMM: B tokens x top-16 routed over `--experts` stacked experts, Triton
`mxfp4_expert_matmul` against a loop of bf16 `torch.matmul` over the active experts.
Then one Latent MoE layer's routed experts as the trunk runs them (`LatentMoE.routed`: K3 expert
shapes, `--experts` MXFP4 experts, top-16): grouped (two `expert_matmul` launches, the CUDA
default) against the per-expert loop (the dense MXFP4 kernel three times per active expert);
target >= 2x. Output is Markdown tables for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

SHAPES = [("w1/w3", 3072, 3584), ("w2", 3584, 3072)]  # (name, out_features N, in_features K)
TOP_K = 16


def dequantize_then_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from textcore import mxfp4

    return torch.matmul(x, mxfp4.dequantize(packed, scale, x.dtype).T)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--experts", type=int, default=64, help="stacked experts in the grouped test (default 64)")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench time per figure in ms (default 200)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET; this benchmark compiles the kernels for the GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "error: no CUDA GPU visible; this benchmark needs one (the CPU figures are bench/mxfp4.py)", file=sys.stderr
        )
        return 2

    import triton
    from triton.testing import do_bench

    from textcore import mxfp4
    from textcore.mxfp4_triton import mxfp4_expert_matmul, mxfp4_matmul

    dev = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}\n")

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=args.rep_ms) * 1e3  # microseconds

    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        packed, scale = mxfp4.quantize(w)
        dense = mxfp4.dequantize(packed, scale)  # the same weights, unpacked
        print(f"## {name}: [B, {k}] x [{k}, {n}]\n")
        print("| B | Triton MXFP4 us | bf16 torch.matmul us | speed-up | torch dequant+matmul us | max rel err |")
        print("|---|---|---|---|---|---|")
        for b in batches:
            x = torch.randn(b, k, device=dev).bfloat16()
            y = mxfp4_matmul(x, packed, scale)
            ref = x.float() @ dense.float().T
            rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not rel < 1e-2:
                print(f"error: kernel mismatch at B={b}: max relative error {rel:.3e}", file=sys.stderr)
                return 1
            t_k = bench(partial(mxfp4_matmul, x, packed, scale))
            t_bf16 = bench(partial(torch.matmul, x, dense.T))
            t_deq = bench(partial(dequantize_then_matmul, x, packed, scale))
            print(f"| {b} | {t_k:.1f} | {t_bf16:.1f} | {t_bf16 / t_k:.2f}x | {t_deq:.1f} | {rel:.1e} |")
        print()

    n, k = SHAPES[0][1], SHAPES[0][2]
    e_total = args.experts
    ws = (torch.randn(e_total, n, k, device=dev) * 0.02).bfloat16()
    quantized = [mxfp4.quantize(ws[e]) for e in range(e_total)]
    packed = torch.stack([p for p, _ in quantized])
    scale = torch.stack([s for _, s in quantized])
    dense = torch.stack([mxfp4.dequantize(p, s) for p, s in quantized])
    print(f"## grouped experts (w1 shape, {e_total} stacked, top-{TOP_K} per token)\n")
    print("| tokens | rows | active experts | Triton grouped us | bf16 per-expert loop us | speed-up | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        ids = torch.stack([torch.randperm(e_total, device=dev)[:TOP_K] for _ in range(b)]).flatten()
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=e_total)
        offsets = torch.zeros(e_total + 1, dtype=torch.int32, device=dev)
        offsets[1:] = counts.cumsum(0)
        x = torch.randn(b, k, device=dev).bfloat16()[order // TOP_K].contiguous()
        active = [(e, int(offsets[e]), int(offsets[e + 1])) for e in range(e_total) if counts[e] > 0]

        def loop(x=x, active=active):
            return [torch.matmul(x[a:z], dense[e].T) for e, a, z in active]

        y = mxfp4_expert_matmul(x, offsets, packed, scale)
        ref = torch.cat([x[a:z].float() @ dense[e].float().T for e, a, z in active])
        rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        if not rel < 1e-2:
            print(f"error: grouped kernel mismatch at {b} tokens: max relative error {rel:.3e}", file=sys.stderr)
            return 1
        t_k = bench(partial(mxfp4_expert_matmul, x, offsets, packed, scale))
        t_loop = bench(loop)
        print(f"| {b} | {b * TOP_K} | {len(active)} | {t_k:.1f} | {t_loop:.1f} | {t_loop / t_k:.2f}x | {rel:.1e} |")
    return moe_layer(batches, e_total, dev, bench)


def routed_experts(num_experts: int, device: torch.device):
    """A K3 Latent MoE layer with `num_experts` random MXFP4 experts on `device`, grouped as a loaded
    checkpoint's are; only the routed experts are real (the rest stays on the meta device)."""
    import dataclasses

    from textcore import mxfp4
    from textcore.config import k3
    from textcore.moe import LatentMoE

    cfg = dataclasses.replace(k3(), num_experts=num_experts)
    with torch.device("meta"):
        moe = LatentMoE(cfg, dtype=torch.bfloat16)
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            meta = getattr(expert, name)
            layer = mxfp4.MXFP4Linear(meta.in_features, meta.out_features, device=device)
            w = torch.randn(meta.out_features, meta.in_features, device=device) * meta.in_features ** -0.5
            layer.weight_packed, layer.weight_scale = mxfp4.quantize(w)
            setattr(expert, name, layer)
    assert moe.group_experts()
    return moe, cfg


def moe_layer(batches: list[int], num_experts: int, dev: torch.device, bench) -> int:
    moe, cfg = routed_experts(num_experts, dev)
    latent = cfg.routed_expert_hidden_size
    print(f"\n## Latent MoE routed experts, one layer: {num_experts} MXFP4 experts "
          f"({latent} -> {cfg.moe_intermediate_size} -> {latent}), top-{TOP_K}\n")
    print("| tokens | active experts | grouped us | per-expert loop us | speed-up | max rel diff |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for b in batches:
        z = torch.randn(b, latent, device=dev, generator=gen).bfloat16()
        ids = torch.rand(b, num_experts, device=dev, generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.rand(b, TOP_K, device=dev, generator=gen)
        weights /= weights.sum(-1, keepdim=True)

        def routed(backend: str, z=z, ids=ids, weights=weights) -> torch.Tensor:
            moe.expert_backend = backend
            return moe.routed(z, ids, weights)

        grouped, loop = routed("grouped"), routed("loop")
        rel = ((grouped - loop).abs().max() / loop.abs().max()).item()
        if not rel < 1e-2:
            print(f"error: grouped MoE differs from the loop at {b} tokens: max relative {rel:.3e}", file=sys.stderr)
            return 1
        t_grouped, t_loop = bench(partial(routed, "grouped")), bench(partial(routed, "loop"))
        active = int(torch.unique(ids).numel())
        print(f"| {b} | {active} | {t_grouped:.1f} | {t_loop:.1f} | {t_loop / t_grouped:.2f}x | {rel:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
