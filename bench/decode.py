"""Benchmark: batched decode of the trunk, tokens/s at 1, 8 and 32 sequences.

    python -m bench.decode --device cuda:0 --preset k3-slice [--batches 1,8,32] [--steps 64]   # a GPU
    python -m bench.decode --device cpu --preset tiny --steps 16                              # CPU smoke run

Each of B sequences is prefilled alone into its own cache (`SequenceCache`, prompts of different
lengths: 256 + 37 i tokens), then all B decode together greedily, one token each per step, through
the calls the service's scheduler makes each step (`textcore.generate.decode_step`, `sample_batch`;
a scheduler step with no prompt chunk in it is exactly this one): the KDA states stacked per step,
the absorbed MLA attention over each row's own length, every sequence's token in one MoE call.
Timed: `--steps` decode steps after 2 untimed ones (CUDA synchronised). Reported per B: ms per
step, tokens/s, and the speed-up over B = 1.

Presets: `tiny` (textcore.config.tiny, fp32, random weights: what the CPU figures use) and
`k3-slice` (the K3 widths, heads and top-16 routing in bf16, cut to `--layers` layers, the first
dense, every fourth MLA, and `--experts` MXFP4 routed experts, grouped as a loaded checkpoint's
are: the routed experts run the grouped Triton kernel on CUDA). No target; the GPU figure is for
docs/BENCHMARKS.md (bench/gpu_all.sh runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from textcore import mxfp4
from textcore.config import TextConfig, k3, tiny
from textcore.generate import Sampler, SamplingParams, TokenSpace, decode_step, sample_batch
from textcore.model import KimiLinearForCausalLM, TrunkCache, init_tensor
from textcore.moe import LatentMoE

PROMPT, SPREAD = 256, 37  # prompt lengths 256 + 37 i


def k3_slice(layers: int, experts: int) -> TextConfig:
    return dataclasses.replace(k3(), num_hidden_layers=layers, full_attn_layers=tuple(range(4, layers + 1, 4)),
                               num_experts=experts)


def build(preset: str, device: torch.device, layers: int, experts: int) -> KimiLinearForCausalLM:
    """Random weights made on `device` (the K3 slice's would not fit a host's memory as fp32)."""
    if preset == "tiny":
        return KimiLinearForCausalLM.random(tiny(), seed=0).to(device)
    cfg = k3_slice(layers, experts)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, dtype=torch.bfloat16)
    quant = mxfp4.K3_QUANTIZATION_CONFIG  # the release packs only the routed experts, not their latent projections
    mxfp4.apply_quantization_config(model, {**quant, "ignore": [*quant["ignore"], r"re:.*routed_expert_.*"]})
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, mxfp4.MXFP4Linear):
                w = init_tensor(f"{name}.weight", (module.out_features, module.in_features), gen)
                packed, scale = mxfp4.quantize(w)
                module.weight_packed.copy_(packed)
                module.weight_scale.copy_(scale)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not name.endswith(("weight_packed", "weight_scale")):
                tensor.copy_(init_tensor(name, tuple(tensor.shape), gen))
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.group_experts()
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_rate(model: KimiLinearForCausalLM, batch: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds per step, tokens/s) of `batch` sequences decoding together."""
    gen = torch.Generator().manual_seed(batch)
    caches, tokens = [], []
    greedy = SamplingParams(max_new_tokens=steps + 3, ignore_eos=True)
    space = TokenSpace(model.cfg.vocab_size)
    samplers = [Sampler(greedy, space, device) for _ in range(batch)]
    pool = model.new_pool()  # one pool: a decode step gathers every sequence's blocks at once
    for i in range(batch):
        length = PROMPT + SPREAD * i
        prompt = torch.randint(0, model.cfg.vocab_size, (1, length), generator=gen).to(device)
        caches.append(model.new_sequence(pool))
        logits = model(prompt, cache=TrunkCache([caches[-1]]), last_only=True)
        tokens.append(sample_batch(logits, samplers[i:i + 1])[0].token_id)
    for _ in range(2):  # warm up (kernel choice, allocator)
        tokens = [s.token_id for s in sample_batch(decode_step(model, caches, tokens, space), samplers)]
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        tokens = [s.token_id for s in sample_batch(decode_step(model, caches, tokens, space), samplers)]
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    return seconds, batch / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--preset", choices=("tiny", "k3-slice"), default="k3-slice")
    parser.add_argument("--batches", default="1,8,32", help="sequence counts (default 1,8,32)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per count (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="k3-slice: layers (default 4: 3 KDA, 1 MLA)")
    parser.add_argument("--experts", type=int, default=64, help="k3-slice: routed experts (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build(args.preset, device, args.layers, args.experts)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {name}; preset {args.preset} ({model.cfg.num_hidden_layers} layers, "
          f"{model.cfg.num_experts} experts, {model.dtype}); prompts {PROMPT} + {SPREAD} i tokens; {args.steps} steps")
    print("\n| sequences | ms / step | tokens/s | vs 1 sequence |\n|---|---|---|---|")
    single = None
    for batch in (int(b) for b in args.batches.split(",")):
        seconds, rate = decode_rate(model, batch, args.steps, device)
        single = single or rate
        print(f"| {batch} | {seconds * 1e3:.1f} | {rate:,.0f} | {rate / single:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
