"""Parameter, disk and cache arithmetic of the KimiLinear trunk, from the real modules on the meta device.

One decoder layer of each kind (dense KDA, MoE KDA, MoE MLA, ...) is built on the meta device and
counted, then multiplied by how many layers of that kind the config has, so the K3 numbers come
from the same modules that run, without allocating (or building 247k expert modules).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from textcore.config import TextConfig
from textcore.model import MULTIMODAL_PREFIX, DecoderLayer, KimiLinearForCausalLM
from textcore.mxfp4 import K3_QUANTIZATION_CONFIG, quantized_modules

MXFP4_BITS_PER_WEIGHT = 4.25  # 4-bit code + one 8-bit E8M0 scale per 32 weights
CHECKPOINT_DTYPE = torch.bfloat16  # everything that is not packed (fp32 tensors stay fp32)


def _layer_kind(cfg: TextConfig, i: int) -> tuple[bool, bool]:
    return cfg.is_kda(i), cfg.is_moe(i)


def _count(module: nn.Module, prefix: str, quant_config: dict) -> dict[str, int]:
    """Counts of one module whose parameters live under checkpoint prefix `prefix`."""
    params = dict(module.named_parameters())
    linear = {prefix + n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    names = [prefix + n for n in params]
    shapes = {prefix + n: tuple(p.shape) for n, p in params.items()}
    packed = {m + ".weight" for m in quantized_modules(names, quant_config, shapes, linear_modules=linear)}
    c = {"total": 0, "routed_experts": 0, "attention": 0, "quantized": 0, "unpacked_bytes": 0, "embedding": 0}
    for n, p in params.items():
        full, k = prefix + n, p.numel()
        c["total"] += k
        if ".experts." in full:
            c["routed_experts"] += k
        if ".self_attn." in full:
            c["attention"] += k
        if full.endswith("embed_tokens.weight"):
            c["embedding"] += k
        if full in packed:
            c["quantized"] += k
        else:
            c["unpacked_bytes"] += k * (4 if p.dtype == torch.float32 else CHECKPOINT_DTYPE.itemsize)
    return c


def trunk_counts(cfg: TextConfig, quant_config: dict | None = None) -> dict[str, int]:
    """The issue-5 keys for the text trunk (see module doc)."""
    quant_config = quant_config or K3_QUANTIZATION_CONFIG
    p = MULTIMODAL_PREFIX
    with torch.device("meta"):
        one_layer = dataclasses.replace(cfg, num_hidden_layers=1, full_attn_layers=())
        shell = KimiLinearForCausalLM(one_layer, dtype=CHECKPOINT_DTYPE)
        del shell.model.layers  # only the embedding, final norms and lm_head are counted from here
        totals = _count(shell, p, quant_config)
        first_of_kind: dict[tuple[bool, bool], int] = {}
        layers_of_kind: dict[tuple[bool, bool], int] = {}
        for i in range(cfg.num_hidden_layers):
            kind = _layer_kind(cfg, i)
            first_of_kind.setdefault(kind, i)
            layers_of_kind[kind] = layers_of_kind.get(kind, 0) + 1
        for kind, i in first_of_kind.items():
            layer_counts = _count(DecoderLayer(cfg, i, dtype=CHECKPOINT_DTYPE), f"{p}model.layers.{i}.", quant_config)
            for key, v in layer_counts.items():
                totals[key] += v * layers_of_kind[kind]
    n_kda = sum(cfg.is_kda(i) for i in range(cfg.num_hidden_layers))
    n_mla = cfg.num_hidden_layers - n_kda
    inactive = totals["routed_experts"] * (cfg.num_experts - cfg.num_experts_per_token) // cfg.num_experts
    return {
        "total": totals["total"],
        # an embedding lookup reads one row, so the table is not counted as active
        "active_per_token": totals["total"] - inactive - totals["embedding"],
        "routed_experts": totals["routed_experts"],
        "attention": totals["attention"],
        "quantized": totals["quantized"],
        "disk_bytes": round(totals["quantized"] * MXFP4_BITS_PER_WEIGHT / 8) + totals["unpacked_bytes"],
        "kda_layers": n_kda,
        "mla_layers": n_mla,
        "kda_state_bytes_fp32": n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4,
        "kda_conv_state_bytes_fp32": n_kda * 3 * cfg.kda_num_heads * cfg.kda_head_dim
        * (cfg.short_conv_kernel_size - 1) * 4,
        "mla_cache_bytes_per_token_fp8": n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        # the reference implementation caches expanded per-head K (nope + rope) and V in bf16
        "reference_cache_bytes_per_token_bf16": n_mla * cfg.num_attention_heads
        * (cfg.qk_head_dim + cfg.v_head_dim) * 2,
    }
