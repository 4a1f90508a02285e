"""The multimodal projector (release `mm_projector.*`, the `patchmergerv2` type).

Merged tokens `[N, 4 x 1024]` -> Linear(4096 -> 4096) -> exact GELU -> Linear(4096 -> 7168)
-> RMSNorm(7168, eps 1e-5): rows the text trunk takes in place of `media_pad`. Tensor names:
    proj.0.weight     [4D, 4D]
    proj.2.weight     [text_hidden, 4D]
    post_norm.weight  [text_hidden]
"""

from __future__ import annotations

import torch
from torch import nn

from vision.config import VisionConfig


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.merged_hidden_size
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=False),
            nn.GELU(),  # exact (erf) GELU, unlike the tower's tanh approximation
            nn.Linear(width, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))
