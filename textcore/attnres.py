"""Attention Residuals (block form): the residual stream replaced by a learned depth softmax.

The stream state is (block checkpoints, partial sum). At every layer i with i % block == 0 the
partial sum is pushed as a checkpoint and restarts (layer 0 pushes the embeddings). Before each
attention, each FFN and the final norm, the input is

    sum_n softmax_n( <RMSNorm(v_n), norm.weight * proj.weight> ) v_n

over the checkpoints and the current partial sum (if any), in fp32, over the un-normalised v_n and
without a 1/sqrt(d). Every layer has its own (norm, proj) pair for attention and for the FFN, the
model one for the output; the usual input / post-attention RMSNorms still apply after the mix.
Everything is per token, so decoding needs no extra cache.
"""

from __future__ import annotations

import torch

from textcore.kda import RMSNorm


def depth_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: torch.nn.Linear) -> torch.Tensor:
    """Softmax-over-depth mix of `sources` (each `[..., hidden]`), returned in the sources' dtype."""
    if len(sources) == 1:
        return sources[0]  # softmax over one source is exactly 1
    v = torch.stack([s.float() for s in sources])  # [N, ..., hidden]
    w = norm.weight.float() * proj.weight.float().reshape(-1)
    rrms = torch.rsqrt(v.pow(2).mean(-1) + norm.eps)
    probs = torch.softmax((v @ w) * rrms, dim=0)  # [N, ...]
    return (probs.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


class AttnResStream:
    """The per-forward stream state. Works on any device, including meta (shape-only)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.checkpoints: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embeddings

    def begin_layer(self, i: int) -> None:
        if i % self.block_size == 0:
            self.checkpoints.append(self.partial)
            self.partial = None

    def sources(self) -> list[torch.Tensor]:
        return self.checkpoints + ([self.partial] if self.partial is not None else [])

    def mix(self, norm: RMSNorm, proj: torch.nn.Linear) -> torch.Tensor:
        return depth_mix(self.sources(), norm, proj)

    def add(self, delta: torch.Tensor) -> None:
        self.partial = delta if self.partial is None else self.partial + delta
