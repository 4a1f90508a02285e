"""MoonViT-3D, the Kimi-K3 vision tower (docs/MODEL.md §8), top to bottom.

patch embed -> + learnable position grid -> 27 pre-norm blocks (2-D RoPE, attention within
each image only) -> final RMSNorm -> 2x2 merger. Input is a packed batch: the patches of every
image one after another (raster order per image), with one `(t, h, w)` grid per image.

Module and parameter names equal the release's tensor names under `vision_tower.`, so a real
checkpoint loads with no renaming:
    patch_embed.proj.weight              [D, 3, 14, 14]
    patch_embed.pos_emb.weight           [64, 64, D]
    encoder.blocks.{i}.norm0.weight      [D]
    encoder.blocks.{i}.wqkv.weight       [3 * Q, D]    rows: q (all heads), k, v; Q = heads x head_dim
    encoder.blocks.{i}.wo.weight         [D, Q]
    encoder.blocks.{i}.norm1.weight      [D]
    encoder.blocks.{i}.mlp.fc0.weight    [I, D]
    encoder.blocks.{i}.mlp.fc1.weight    [D, I]
    encoder.final_layernorm.weight       [D]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vision.config import MAX_GRID_SIDE, ROPE_THETA, VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches


def check_grids(grids: Sequence[Sequence[int]], num_patches: int, cfg: VisionConfig) -> list[Grid]:
    """Validate per-image grids against the packed patch count; return them as int triples."""
    out: list[Grid] = []
    kh, kw = cfg.merge_kernel_size
    for i, g in enumerate(grids):
        if len(g) != 3:
            raise ValueError(f"image {i}: grid_thw must be (t, h, w), got {tuple(g)}")
        t, h, w = (int(v) for v in g)
        if not 1 <= t <= cfg.init_pos_emb_time:
            raise ValueError(f"image {i}: t={t} frames, the tower takes 1..{cfg.init_pos_emb_time}")
        if not (1 <= h <= MAX_GRID_SIDE and 1 <= w <= MAX_GRID_SIDE):
            raise ValueError(f"image {i}: grid {h}x{w} patches, each side must be 1..{MAX_GRID_SIDE}")
        if h % kh or w % kw:
            raise ValueError(f"image {i}: grid {h}x{w} patches is not a multiple of the {kh}x{kw} merger")
        out.append((t, h, w))
    total = sum(t * h * w for t, h, w in out)
    if total != num_patches:
        raise ValueError(f"grids describe {total} patches but {num_patches} were given")
    return out


@functools.lru_cache(maxsize=8)
def sincos_time_table(dim: int, frames: int) -> torch.Tensor:
    """Fixed 1-D sin|cos table `[frames, dim]`, computed in float32 numpy as the reference does."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000**omega
    angles = np.einsum("m,d->md", np.arange(frames, dtype=np.float32), omega)
    return torch.from_numpy(np.concatenate([np.sin(angles), np.cos(angles)], axis=1)).float()


class PositionGrid(nn.Module):
    """Learnable `[64, 64, D]` grid, bilinearly resized to each image's patch grid (used as is at
    64x64); frames t > 1 add the fixed sincos time table."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size))

    def forward(self, t: int, h: int, w: int) -> torch.Tensor:
        if (h, w) == tuple(self.weight.shape[:2]):
            pos = self.weight.flatten(0, 1)
        else:
            grid = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, D, 64, 64]
            pos = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False, antialias=False)
            pos = pos.squeeze(0).permute(1, 2, 0).flatten(0, 1)
        if t == 1:
            return pos
        time = sincos_time_table(pos.shape[-1], t).to(device=pos.device, dtype=pos.dtype)
        return (pos.unsqueeze(0) + time.unsqueeze(1)).flatten(0, 1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PositionGrid(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        # A 14x14 convolution with stride 14 over a 14x14 patch is one dot product per output
        # channel: run it as a single matmul over all patches.
        x = F.linear(pixels.flatten(1), self.proj.weight.flatten(1))
        return x + torch.cat([self.pos_emb(t, h, w) for t, h, w in grids])


def rope_2d(grids: list[Grid], head_dim: int, device: torch.device) -> torch.Tensor:
    """complex64 `[sum(t*h*w), head_dim/2]`: slot 2i rotates by x (column) * f_i, slot 2i+1 by
    y (row) * f_i, f_i = theta^(-4i/head_dim). Frames of one image share the 2-D positions."""
    quarter = head_dim // 4
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[:quarter].float() / head_dim)
    out = []
    for t, h, w in grids:
        x_angles = torch.outer(torch.arange(w, device=device, dtype=torch.float32), freqs)  # [w, q]
        y_angles = torch.outer(torch.arange(h, device=device, dtype=torch.float32), freqs)  # [h, q]
        x_cis = torch.polar(torch.ones_like(x_angles), x_angles)
        y_cis = torch.polar(torch.ones_like(y_angles), y_angles)
        cis = torch.stack([x_cis.unsqueeze(0).expand(h, w, quarter), y_cis.unsqueeze(1).expand(h, w, quarter)], -1)
        out.append(cis.reshape(h * w, 2 * quarter).repeat(t, 1))
    return torch.cat(out)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of `x` `[L, heads, head_dim]` by `cis` `[L, head_dim/2]`, in float32."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis.unsqueeze(1)).flatten(-2).type_as(x)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.vt_num_attention_heads
        self.head_dim = cfg.head_dim
        self.norm0 = nn.RMSNorm(cfg.vt_hidden_size)  # eps=None: torch's default, finfo(dtype).eps, as the reference
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.vt_hidden_size, bias=False)
        self.norm1 = nn.RMSNorm(cfg.vt_hidden_size)
        self.mlp = MLP(cfg)

    def attention(self, x: torch.Tensor, cis: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, cis), apply_rope(k, cis)
        # Non-causal attention inside each image's span only (what varlen attention with
        # cu_seqlens computes); one SDPA call per image as [1, heads, n, head_dim] (4-D inputs
        # get the fused flash kernel on CPU too; 3-D ones fall back to the O(n^2)-memory math path).
        outs = [
            F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2)
            )[0].transpose(0, 1)
            for s, e in spans
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.wo(out.reshape(x.shape[0], -1))

    def forward(self, x: torch.Tensor, cis: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cis, spans)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = nn.RMSNorm(cfg.vt_hidden_size)

    def forward(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        cis = rope_2d(grids, self.head_dim, x.device)
        bounds = np.cumsum([0] + [t * h * w for t, h, w in grids]).tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        for block in self.blocks:
            x = block(x, cis, spans)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grids: list[Grid], kernel: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """2x2 merger with temporal mean: per image `[t*h*w, D]` -> `[(h/2)(w/2), 4D]`, where a merged
    token's 4 blocks of D are its patches (0,0), (0,1), (1,0), (1,1) (row, column in the 2x2)."""
    kh, kw = kernel
    d = x.shape[-1]
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start : start + t * h * w].view(t, h // kh, kh, w // kw, kw, d)
        merged = seq.permute(0, 1, 3, 2, 4, 5).mean(0)
        out.append(merged.reshape((h // kh) * (w // kw), kh * kw * d))
        start += t * h * w
    return torch.cat(out)


class VisionTower(nn.Module):
    """Packed patches `[L, 3, 14, 14]` + per-image grids -> merged tokens `[sum (h/2)(w/2), 4D]`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        p = self.config.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}], got {list(pixel_values.shape)}")
        checked = check_grids(grids, pixel_values.shape[0], self.config)
        w = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(device=w.device, dtype=w.dtype), checked)
        x = self.encoder(x, checked)
        return merge_patches(x, checked, self.config.merge_kernel_size)
