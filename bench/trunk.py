"""Benchmark: the KimiLinear trunk on the CPU.

    .venv/bin/python -m bench.trunk [--T 4096] [--heads 8] [--threads 1] [--repeats 2] [--decode-tokens 32]
                                    [--prefill-tokens 2872,15625]

- KDA: `chunk_kda` (chunked WY form) against `recurrent_kda` (token by token) on the same inputs
  in the same run (best of `--repeats`), at K = V = 128 (the K3 head size), T tokens, `--heads`
  heads, batch 1; target: chunk >= 5x faster at T = 4096. Also their max abs difference.
- decode: tiny-config (`textcore.config.tiny`, fp32) greedy decode tokens/s after a 32-token
  prefill, at batch 1 and 4 (decode steps only; the prefill is timed separately).
- prefill by layer kind: one tiny-config forward over a whole prompt of each `--prefill-tokens`
  length (random embeddings; the 1920x1080 and the 12 MP chats' lengths by default), its time in
  the MLA layers (attention over every earlier token: quadratic in T by the model's design), the
  KDA layers and the FFNs (linear), and against linear scaling from the first length.

The machine is shared: compare the numbers of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from textcore.config import tiny
from textcore.kda import chunk_kda, l2_normalize, recurrent_kda
from textcore.model import KimiLinearForCausalLM

HEAD_DIM = 128  # K3's KDA head size (K = V)
PREFILL = 32


def kda_inputs(T: int, H: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(1, T, H, HEAD_DIM, generator=gen))
    k = l2_normalize(torch.randn(1, T, H, HEAD_DIM, generator=gen))
    v = torch.randn(1, T, H, HEAD_DIM, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, HEAD_DIM, generator=gen) - 3)  # the layer's gate range
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return q, k, v, g, beta


def best_of(fn, inputs, repeats: int) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, _ = fn(*inputs)
        times.append(time.perf_counter() - t0)
    return min(times), out


def bench_kda(T: int, H: int, repeats: int) -> None:
    inputs = kda_inputs(T, H)
    for fn in (chunk_kda, recurrent_kda):  # warm up
        fn(*kda_inputs(128, H))
    t_chunk, o_chunk = best_of(chunk_kda, inputs, repeats)
    t_rec, o_rec = best_of(recurrent_kda, inputs, repeats)
    diff = (o_chunk - o_rec).abs().max().item()
    print(f"KDA T={T} H={H} K=V={HEAD_DIM}: recurrent {t_rec:.3f} s ({T / t_rec:,.0f} tok/s), "
          f"chunk {t_chunk:.3f} s ({T / t_chunk:,.0f} tok/s), speed-up {t_rec / t_chunk:.1f}x, "
          f"max |diff| {diff:.2e}")


def bench_decode(batch: int, tokens: int) -> None:
    model = KimiLinearForCausalLM.random(tiny(), seed=0)
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, PREFILL), generator=gen)
    model(prompt[:, :2])  # warm up
    cache = model.new_cache(batch)
    t0 = time.perf_counter()
    logits = model(prompt, cache=cache, last_only=True)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = model(logits.argmax(-1)[:, None], cache=cache, last_only=True)
    t_decode = time.perf_counter() - t0
    print(f"tiny decode batch {batch}: prefill {PREFILL} tokens {t_prefill * 1e3:.0f} ms; "
          f"{tokens} steps {t_decode:.2f} s = {batch * tokens / t_decode:,.1f} tok/s "
          f"({t_decode / tokens * 1e3:.1f} ms/step)")


def bench_prefill(lengths: list[int]) -> None:
    from textcore.mla import GatedMLA

    model = KimiLinearForCausalLM.random(tiny(), seed=0)
    spent: dict[str, float] = {}
    started: dict[int, float] = {}
    for layer in model.model.layers:
        for module, kind in ((layer.self_attn, "MLA" if isinstance(layer.self_attn, GatedMLA) else "KDA"),
                             (layer.ffn, "FFN")):
            module.register_forward_pre_hook(lambda m, _: started.__setitem__(id(m), time.perf_counter()))
            module.register_forward_hook(lambda m, _i, _o, kind=kind: spent.__setitem__(
                kind, spent.get(kind, 0.0) + time.perf_counter() - started.pop(id(m))))
    model(inputs_embeds=torch.randn(1, 64, model.cfg.hidden_size), last_only=True)  # warm up
    rows = []
    for T in lengths:
        spent.clear()
        x = torch.randn(1, T, model.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
        t0 = time.perf_counter()
        model(inputs_embeds=x, last_only=True)
        rows.append((T, time.perf_counter() - t0, dict(spent)))
    print("\n| prompt tokens | forward | MLA layers | KDA layers | FFN layers | forward vs linear |")
    print("|---|---|---|---|---|---|")
    first_t, first_s, _ = rows[0]
    for T, seconds, by_kind in rows:
        linear = seconds / first_s / (T / first_t)
        print(f"| {T:,} | {seconds:.2f} s | {by_kind['MLA']:.2f} s | {by_kind['KDA']:.2f} s | {by_kind['FFN']:.2f} s | "
              f"{linear:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=4096, help="KDA sequence length (default 4096)")
    parser.add_argument("--heads", type=int, default=8, help="KDA heads (default 8; K3 has 96)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="KDA timings are the best of N runs (default 2)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps per batch size (default 32)")
    parser.add_argument("--prefill-tokens", default="2872,15625", help="prompt lengths (default 2872,15625)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_kda(args.T, args.heads, args.repeats)
    for batch in (1, 4):
        bench_decode(batch, args.decode_tokens)
    bench_prefill([int(t) for t in args.prefill_tokens.split(",")])


if __name__ == "__main__":
    main()
