"""A small module tree named like the Kimi-K3 checkpoint (tests only).

Real nn.Linear / nn.Embedding layers under the published tensor names
(`language_model.model.layers.{i}...`, `vision_tower...`, `mm_projector...`), small enough to
quantise and load in milliseconds. The quantisation tests use it until the real trunk exists.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 64
EXPERT_HIDDEN = 32  # routed_expert_hidden_size stand-in
EXPERT_INTER = 64  # moe_intermediate_size stand-in
NUM_EXPERTS = 4
VOCAB = 96


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _linears(**shapes: tuple[int, int]) -> nn.ModuleDict:
    return nn.ModuleDict({name: nn.Linear(i, o, bias=False) for name, (i, o) in shapes.items()})


def _layer(dense: bool) -> nn.ModuleDict:
    layer = nn.ModuleDict(
        {
            "input_layernorm": RMSNorm(HIDDEN),
            "self_attn": _linears(
                q_proj=(HIDDEN, HIDDEN), k_proj=(HIDDEN, HIDDEN), v_proj=(HIDDEN, HIDDEN), o_proj=(HIDDEN, HIDDEN)
            ),
        }
    )
    if dense:
        layer["mlp"] = _linears(gate_proj=(HIDDEN, 128), up_proj=(HIDDEN, 128), down_proj=(128, HIDDEN))
    else:
        experts = nn.ModuleList(
            _linears(
                w1=(EXPERT_HIDDEN, EXPERT_INTER), w2=(EXPERT_INTER, EXPERT_HIDDEN), w3=(EXPERT_HIDDEN, EXPERT_INTER)
            )
            for _ in range(NUM_EXPERTS)
        )
        layer["block_sparse_moe"] = nn.ModuleDict(
            {
                "experts": experts,
                "shared_experts": _linears(gate_proj=(HIDDEN, 96), up_proj=(HIDDEN, 96), down_proj=(96, HIDDEN)),
            }
        )
    return layer


def k3_like_tree(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    with torch.device(device):
        tree = nn.ModuleDict(
            {
                "language_model": nn.ModuleDict(
                    {
                        "model": nn.ModuleDict(
                            {
                                "embed_tokens": nn.Embedding(VOCAB, HIDDEN),
                                "layers": nn.ModuleList([_layer(dense=True), _layer(dense=False), _layer(dense=False)]),
                                "norm": RMSNorm(HIDDEN),
                            }
                        ),
                        "lm_head": nn.Linear(HIDDEN, VOCAB, bias=False),
                    }
                ),
                "vision_tower": nn.ModuleDict({"blocks": nn.ModuleList([_linears(fc1=(32, 64), fc2=(64, 32))])}),
                "mm_projector": _linears(linear_1=(32, HIDDEN), linear_2=(HIDDEN, HIDDEN)),
            }
        )
    return tree.to(dtype)


def routed_expert_names(prefix: str = "") -> list[str]:
    return sorted(
        f"{prefix}language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
        for i in (1, 2)
        for e in range(NUM_EXPERTS)
        for w in ("w1", "w2", "w3")
    )
