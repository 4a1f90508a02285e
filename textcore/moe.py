"""SiTU feed-forwards: the dense FFN of layer 0 and the Latent MoE of every other layer.

SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb), beta = 4, lb = 25, computed in fp32
and cast once at the end; g and u are the two halves of cat([w1 x, w3 x]) (not interleaved).

Latent MoE (docs/MODEL.md §11): an fp32 sigmoid router on the full-width x picks the top-k experts
by score + e_score_correction_bias but weights them by the unbiased scores, renormalised and
scaled; the routed experts run in a narrower latent space (down proj -> experts -> weighted sum
-> RMSNorm -> up proj); the shared experts (one SiTU MLP) run on the original x.

The routed experts run one of two ways, with the same result up to float32 summation order:
- the per-expert loop (CPU, dense experts, the reference): the (token, slot) pairs sorted by
  expert, one call of each active expert on exactly its rows; stacked MXFP4 experts are decoded
  first, all the active ones of a step together (as many at a time as `mxfp4._TORCH_CHUNK_BYTES` of
  float32 holds), not each of their three weights on its own;
- grouped (MXFP4 experts on CUDA): the same sort, then one grouped-GEMM launch over all experts
  for w1 and w3 together and one for w2 (`textcore.mxfp4.expert_matmul`), instead of three
  launches per active expert. `group_experts` stacks the packed weights for it once, and each
  expert's own buffers become views of the stack (the weights stay in memory once).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from textcore import mxfp4
from textcore.kda import RMSNorm, linear
from textcore.mxfp4 import PACKED_SUFFIX, SCALE_SUFFIX, MXFP4Linear

RENORM_EPS = 1e-20


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def _decoded_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    betas: tuple[float, float]) -> torch.Tensor:
    """An MXFP4 expert on rows x with its weights already decoded (fp32 `[out, in]`): the products
    its MXFP4Linear layers compute (`mxfp4.matmul` on the CPU), `w2(SiTU(w1 x, w3 x))`."""
    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (a.float() @ w.T).to(a.dtype)

    return mm(situ(mm(x, w1), mm(x, w3), *betas), w2)


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


EXPERT_BACKENDS = ("auto", "grouped", "loop")


def _stack(groups: list[list[MXFP4Linear]], name: str) -> torch.Tensor:
    """`[E, rows, cols]`: buffer `name` of each expert's layers, one layer's rows over the next's;
    each layer's buffer becomes a view into it as it is copied (so the old one is freed)."""
    first = getattr(groups[0][0], name)
    rows = sum(getattr(layer, name).shape[0] for layer in groups[0])
    out = torch.empty(len(groups), rows, first.shape[1], dtype=first.dtype, device=first.device)
    for e, layers in enumerate(groups):
        top = 0
        for layer in layers:
            part = getattr(layer, name)
            view = out[e, top:top + part.shape[0]]
            view.copy_(part)
            setattr(layer, name, view)
            top += part.shape[0]
    return out


class LatentMoE(nn.Module):
    """The checkpoint's `block_sparse_moe`. `expert_backend`: "auto" (grouped for grouped MXFP4
    experts on CUDA, else the loop), "grouped" or "loop" to force one."""

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
        self.betas = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.expert_backend = "auto"
        # (w1 over w3 packed [E, 2I, K/2], its scales [E, 2I, K/32], w2 packed [E, H, I/2], its scales)
        self._grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def group_experts(self) -> bool:
        """Stack the MXFP4 experts' weights for the grouped path (once, after loading; each
        expert's buffers become views of the stacks). False, and nothing changes, unless every
        expert's w1/w2/w3 is an MXFP4Linear without bias."""
        layers = [(e.w1, e.w3, e.w2) for e in self.experts]
        if not all(isinstance(m, MXFP4Linear) and m.bias is None for trio in layers for m in trio):
            return False
        gate_up = [[w1, w3] for w1, w3, _ in layers]
        down = [[w2] for _, _, w2 in layers]
        self._grouped = (_stack(gate_up, PACKED_SUFFIX), _stack(gate_up, SCALE_SUFFIX),
                         _stack(down, PACKED_SUFFIX), _stack(down, SCALE_SUFFIX))
        return True

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LatentMoE:
        # A move (`.to(device)`, ...) replaces each expert's view by a copy of its own: stack again
        # on the new device, so the weights stay in memory once.
        grouped = self._grouped
        super()._apply(fn, recurse)
        w1 = self.experts[0].w1.weight_packed if grouped is not None else None
        if grouped is not None and (w1.device != grouped[0].device or w1.data_ptr() != grouped[0].data_ptr()):
            self._grouped = None
            self.group_experts()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.gate(flat)
        z = self.routed_expert_down_proj(flat)
        routed = self.routed(z, ids, weights)
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed.to(z.dtype)))
        return (out + self.shared_experts(flat)).reshape(shape)

    def routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts on latent rows z `[N, latent]`: float32 `[N, latent]`, each row the
        `weights`-weighted sum of its experts `ids` `[N, k]` (the router's output)."""
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {self.expert_backend!r}")
        if self.expert_backend == "grouped" and self._grouped is None:
            raise ValueError("expert_backend 'grouped' needs MXFP4 experts stacked by group_experts()")
        grouped = self._grouped is not None and (self.expert_backend == "grouped" or
                                                 (self.expert_backend == "auto" and z.is_cuda))
        # Group the (token, slot) pairs by expert.
        expert_of = ids.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        token_of = order // ids.shape[1]
        return (self._grouped_experts if grouped else self._expert_loop)(z, ids, weights, order, token_of)

    def _expert_loop(self, z, ids, weights, order, token_of) -> torch.Tensor:
        """One call per active expert on exactly its rows."""
        routed = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        counts = torch.bincount(ids.reshape(-1), minlength=len(self.experts)).tolist()
        starts = [0, *itertools.accumulate(counts)]
        weight_of = weights.reshape(-1)[order]
        for e, decoded in self._decoded([e for e, n in enumerate(counts) if n]):
            pairs = slice(starts[e], starts[e + 1])
            rows = token_of[pairs]
            y = self.experts[e](z[rows]) if decoded is None else _decoded_expert(z[rows], *decoded, self.betas)
            routed[rows] += y.float() * weight_of[pairs, None]  # a token meets an expert once
        return routed

    def _decoded(self, active: list[int]) -> Iterator[tuple[int, tuple[torch.Tensor, ...] | None]]:
        """Each active expert with its (w1, w3, w2) decoded to fp32, from the stacks, as many experts
        at once as `mxfp4._TORCH_CHUNK_BYTES` holds; None where the experts are not stacked, or one expert
        alone is over the bound (its layers then decode a block of rows at a time)."""
        per_expert = None if self._grouped is None else 8 * (self._grouped[0][0].numel() + self._grouped[2][0].numel())
        if per_expert is None or per_expert > mxfp4._TORCH_CHUNK_BYTES:
            yield from ((e, None) for e in active)
            return
        gate_up_packed, gate_up_scale, down_packed, down_scale = self._grouped
        inter = gate_up_packed.shape[1] // 2
        at_once = mxfp4._TORCH_CHUNK_BYTES // per_expert
        for first in range(0, len(active), at_once):
            group = active[first:first + at_once]
            index = torch.tensor(group, device=gate_up_packed.device)
            gate_up, down = (mxfp4.dequantize(packed[index].flatten(0, 1), scale[index].flatten(0, 1), torch.float32)
                             .view(len(group), packed.shape[1], -1)
                             for packed, scale in ((gate_up_packed, gate_up_scale), (down_packed, down_scale)))
            yield from ((e, (gate_up[j, :inter], gate_up[j, inter:], down[j])) for j, e in enumerate(group))

    def _grouped_experts(self, z, ids, weights, order, token_of) -> torch.Tensor:
        """Two grouped launches over all experts (w1 with w3, then w2); no host sync."""
        gate_up_packed, gate_up_scale, down_packed, down_scale = self._grouped
        num_experts = gate_up_packed.shape[0]
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=z.device)
        offsets[1:] = torch.bincount(ids.reshape(-1), minlength=num_experts).cumsum(0)
        rows = z[token_of]  # sorted by expert
        gate_up = mxfp4.expert_matmul(rows, offsets, gate_up_packed, gate_up_scale, backend="triton")
        inter = gate_up.shape[1] // 2
        y = mxfp4.expert_matmul(situ(gate_up[:, :inter], gate_up[:, inter:], *self.betas), offsets,
                                down_packed, down_scale, backend="triton")
        # Back to (token, slot) order, then the weighted sum over the slots (no atomics: deterministic).
        by_slot = torch.empty_like(y)
        by_slot[order] = y
        return (by_slot.float().view(*ids.shape, -1) * weights[..., None]).sum(1)
