"""Gated multi-head latent attention without RoPE (K3's global layers).

    q = q_b(RMSNorm_qlora(q_a(x)))                  -> heads x [nope | rope]
    [c_kv | k_rot] = kv_a_proj_with_mqa(x);  c = RMSNorm_kvlora(c_kv)
    [k_nope | v] = kv_b(c)                          -> heads x [nope | v]
    score = (q_nope . k_nope + q_rope . k_rot) * (nope + rope)^-0.5, causal softmax in fp32
    out = o_proj(attn * sigmoid(g_proj(x)))

k_rot is one key shared by all heads and is never rotated (mla_use_nope). The cache holds only
the per-token latent [c | k_rot] (kv_lora_rank + rope dims). A prompt (T > 1) is attended in the
expanded form; a decode step (T == 1) in the absorbed form: q_nope is folded through kv_b's key
half into latent space and the latent output through its value half, so nothing is expanded.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from textcore.kda import RMSNorm, linear

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SCALE = 1.0  # the checkpoint ships no KV scales (kv_cache_scheme null)
_warned_fp8 = False


def _warn_fp8_once() -> None:
    global _warned_fp8
    if not _warned_fp8:
        _warned_fp8 = True
        log.warning("fp8 (e4m3) MLA latent cache uses scale %.1f: the checkpoint ships no KV cache scales "
                    "(kv_cache_scheme null), so values above %g saturate", FP8_SCALE, FP8_MAX)


class MLACache:
    """Latent cache of one MLA layer: `[B, S, kv_lora_rank + rope]` plus which keys are padding."""

    def __init__(self, dtype: torch.dtype | None = None):
        if dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"MLA latent cache dtype must be the model dtype or float8_e4m3fn, not {dtype}")
        self.fp8 = dtype == torch.float8_e4m3fn
        if self.fp8:
            _warn_fp8_once()
        self.latent: torch.Tensor | None = None
        self.key_pad: torch.Tensor | None = None  # [B, S] True where the key is left padding

    def append(self, latent: torch.Tensor, key_pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new latents; return all of them (as read back from the cache) in latent's dtype."""
        stored = (latent.float() / FP8_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn) if self.fp8 else latent
        self.latent = stored if self.latent is None else torch.cat([self.latent, stored], dim=1)
        self.key_pad = key_pad if self.key_pad is None else torch.cat([self.key_pad, key_pad], dim=1)
        everything = self.latent.float() * FP8_SCALE if self.fp8 else self.latent
        return everything.to(latent.dtype), self.key_pad

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]


class GatedMLA(nn.Module):
    """Tensor names as in the published checkpoint's `self_attn.*` of a full-attention layer."""

    def __init__(self, cfg, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        H, hidden = self.num_heads, cfg.hidden_size

        def lin(i, o):
            return linear(i, o, dtype)

        self.q_a_proj = lin(hidden, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps, dtype=dtype)
        self.q_b_proj = lin(cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_norm_eps, dtype=dtype)
        self.kv_b_proj = lin(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.g_proj = lin(hidden, H * cfg.v_head_dim)  # sigmoid output gate
        self.o_proj = lin(H * cfg.v_head_dim, hidden)

    def forward(self, x: torch.Tensor, cache: MLACache | None = None,
                pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, T, hidden]`; pad_mask `[B, T]` True at left padding (those keys are never attended)."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        c, k_rot = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)
        key_pad = pad_mask if pad_mask is not None else torch.zeros(B, T, dtype=torch.bool, device=x.device)
        if cache is not None:
            latent, key_pad = cache.append(latent, key_pad)
        c_all, k_rot_all = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        S = latent.shape[1]
        # query t sits at absolute position S - T + t; it sees keys <= itself that are not padding,
        # and always itself (so a padding row stays finite; its output is never used)
        q_pos = torch.arange(S - T, S, device=x.device)
        k_pos = torch.arange(S, device=x.device)
        visible = (k_pos[None, :] <= q_pos[:, None])[None] & ~key_pad[:, None, :]
        visible = visible | (k_pos[None, :] == q_pos[:, None])[None]  # [B, T, S]
        w_kv = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        if T == 1 and cache is not None:
            # absorbed: scores and values in latent space
            q_lat = torch.einsum("bthn,hnc->bthc", q_nope.float(), w_kv[:, : self.nope].float())
            scores = torch.einsum("bthc,bsc->bhts", q_lat, c_all.float())
            scores = scores + torch.einsum("bthr,bsr->bhts", q_rope.float(), k_rot_all.float())
            probs = self._softmax(scores, visible)
            o_lat = torch.einsum("bhts,bsc->bthc", probs, c_all.float())
            attn = torch.einsum("bthc,hvc->bthv", o_lat, w_kv[:, self.nope:].float())
        else:
            kv_up = self.kv_b_proj(c_all).view(B, S, H, self.nope + self.v_dim)
            k_nope, v = kv_up.split([self.nope, self.v_dim], dim=-1)
            scores = torch.einsum("bthn,bshn->bhts", q_nope.float(), k_nope.float())
            scores = scores + torch.einsum("bthr,bsr->bhts", q_rope.float(), k_rot_all.float())
            probs = self._softmax(scores, visible)
            attn = torch.einsum("bhts,bshv->bthv", probs, v.float())
        gate = torch.sigmoid(self.g_proj(x).float()).view(B, T, H, self.v_dim)
        return self.o_proj((attn * gate).reshape(B, T, H * self.v_dim).to(x.dtype))

    def _softmax(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        scores = (scores * self.scale).masked_fill(~visible[:, None], float("-inf"))
        return torch.softmax(scores, dim=-1)
