"""SiTU feed-forwards: the dense FFN of layer 0 and the Latent MoE of every other layer.

SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb), beta = 4, lb = 25, computed in fp32
and cast once at the end; g and u are the two halves of cat([w1 x, w3 x]) (not interleaved).

Latent MoE (K3_FACTS section 4): an fp32 sigmoid router on the full-width x picks the top-k experts
by score + e_score_correction_bias but weights them by the unbiased scores, renormalised and
scaled; the routed experts run in a narrower latent space (down proj -> experts -> weighted sum
-> RMSNorm -> up proj); the shared experts (one SiTU MLP) run on the original x.
"""

from __future__ import annotations

import torch
from torch import nn

from textcore.kda import RMSNorm, linear

RENORM_EPS = 1e-20


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


class SiTUMLP(nn.Module):
    """`down_proj(SiTU(gate_proj x, up_proj x))`: the dense layer-0 FFN and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, cfg, dtype=None):
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype)
        self.up_proj = linear(hidden, intermediate, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)
        self.betas = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), *self.betas))


class Expert(nn.Module):
    """One routed expert, `w2(SiTU(w1 x, w3 x))` (checkpoint names `experts.{e}.w1/w2/w3`)."""

    def __init__(self, hidden: int, intermediate: int, cfg, dtype=None):
        super().__init__()
        self.w1 = linear(hidden, intermediate, dtype)
        self.w2 = linear(intermediate, hidden, dtype)
        self.w3 = linear(hidden, intermediate, dtype)
        self.betas = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(situ(self.w1(x), self.w3(x), *self.betas))


class Router(nn.Module):
    """`gate.weight` [E, hidden] and `gate.e_score_correction_bias` [E] (fp32)."""

    def __init__(self, hidden: int, cfg, dtype=None):
        super().__init__()
        self.top_k = cfg.num_experts_per_token
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, hidden]` -> (expert ids `[N, k]`, fp32 weights `[N, k]`)."""
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        # the bias only chooses; it never weights
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        w = scores.gather(-1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS) * self.scaling


class LatentMoE(nn.Module):
    """The checkpoint's `block_sparse_moe`."""

    def __init__(self, cfg, dtype=None):
        super().__init__()
        hidden, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = Router(hidden, cfg, dtype)
        self.experts = nn.ModuleList(
            Expert(latent, cfg.moe_intermediate_size, cfg, dtype) for _ in range(cfg.num_experts)
        )
        self.routed_expert_down_proj = linear(hidden, latent, dtype)
        self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps, dtype=dtype)
        self.routed_expert_up_proj = linear(latent, hidden, dtype)
        self.shared_experts = SiTUMLP(hidden, cfg.shared_intermediate_size, cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.gate(flat)
        z = self.routed_expert_down_proj(flat)
        routed = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        # group the (token, slot) pairs by expert: one call per expert on exactly its rows
        expert_of = ids.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                y = self.experts[e](z[rows])
                routed[rows] += y.float() * weight_of[start:start + n, None]  # a token meets an expert once
                start += n
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed.to(z.dtype)))
        return (out + self.shared_experts(flat)).reshape(shape)
