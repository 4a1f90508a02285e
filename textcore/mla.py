"""Gated multi-head latent attention without RoPE (K3's global layers).

    q = q_b(RMSNorm_qlora(q_a(x)))                  -> heads x [nope | rope]
    [c_kv | k_rot] = kv_a_proj_with_mqa(x);  c = RMSNorm_kvlora(c_kv)
    [k_nope | v] = kv_b(c)                          -> heads x [nope | v]
    score = (q_nope . k_nope + q_rope . k_rot) * (nope + rope)^-0.5, causal softmax in fp32
    out = o_proj(attn * sigmoid(g_proj(x)))

k_rot is one key shared by all heads and is never rotated (mla_use_nope). The cache holds only
the per-token latent [c | k_rot] (kv_lora_rank + rope dims), one buffer per sequence. A prompt
(T > 1) is attended in the expanded form through `scaled_dot_product_attention` (flash kernels on
CPU and CUDA): a whole prompt in one causal call, a chunk that continues a cached prefix one block
of QUERY_CHUNK queries at a time with that block's mask only. Memory grows linearly with the
context: no `[H, T, S]` scores, no `[T, S]` mask. On the CPU that attention, the trunk's one op
of quadratic work, may take more torch threads than the rest (`GatedMLA.attention_threads`: the
serving engine gives it the CPUs its encoder workers leave idle). A decode step (T == 1) uses the
absorbed form: q_nope is folded through kv_b's key half into latent space and the latent output
through its value half, so nothing is expanded; the decode tokens of a batch's sequences
(`textcore.segments`) attend together over the longest one's latents, each row masked to its own
length.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from textcore.kda import RMSNorm, linear
from textcore.segments import Segments

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SCALE = 1.0  # the checkpoint ships no KV scales (kv_cache_scheme null)
_warned_fp8 = False
# Queries of a chunk after a cached prefix attended at once: each block's mask is [QUERY_CHUNK, S]
QUERY_CHUNK = 256
# Query-key scores (all heads) a prompt's attention must reach before it may run on more threads than
# the rest of the trunk (`GatedMLA.attention_threads`): ~1 ms of work on one CPU thread, far more
# than waking the others costs. The trunk's other ops are too small to gain from them.
WIDE_ATTENTION_SCORES = 1 << 20


def _warn_fp8_once() -> None:
    global _warned_fp8
    if not _warned_fp8:
        _warned_fp8 = True
        log.warning("fp8 (e4m3) MLA latent cache uses scale %.1f: the checkpoint ships no KV cache scales "
                    "(kv_cache_scheme null), so values above %g saturate", FP8_SCALE, FP8_MAX)


class MLACache:
    """One sequence's latents in one MLA layer: a `[capacity, kv_lora_rank + rope]` buffer filled up
    to `length`. The buffer is allocated by the first append, `capacity` rows (a caller that reserved
    its worst case never reallocates) or what that append needs; more rows double it."""

    def __init__(self, capacity: int = 0, dtype: torch.dtype | None = None):
        if dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"MLA latent cache dtype must be the model dtype or float8_e4m3fn, not {dtype}")
        self.fp8 = dtype == torch.float8_e4m3fn
        if self.fp8:
            _warn_fp8_once()
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def append(self, latent: torch.Tensor) -> None:
        """Store `latent` `[T, dims]` after the rows already held."""
        stored = (latent.float() / FP8_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn) if self.fp8 else latent
        end = self.length + latent.shape[0]
        if self.buffer is None or end > self.buffer.shape[0]:
            rows = max(end, self.capacity, 2 * (0 if self.buffer is None else self.buffer.shape[0]))
            grown = stored.new_empty(rows, latent.shape[1])
            if self.buffer is not None:
                grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        self.buffer[self.length:end] = stored
        self.length = end

    def latents(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows held, `[length, dims]`, as read back from the cache, in `dtype`."""
        held = self.buffer[:self.length]
        return (held.float() * FP8_SCALE).to(dtype) if self.fp8 else held.to(dtype)

    def read_into(self, out: torch.Tensor) -> None:
        """Write the rows held, as read back from the cache, into `out` `[length, dims]` (fp32:
        exactly `latents`' values, which fp8 and the model's dtype both hold)."""
        out.copy_(self.buffer[:self.length])
        if self.fp8:
            out.mul_(FP8_SCALE)

    def clone(self) -> MLACache:
        copy = MLACache.__new__(MLACache)
        copy.fp8, copy.capacity, copy.length = self.fp8, self.capacity, self.length
        copy.buffer = None if self.buffer is None else self.buffer.clone()
        return copy

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype, latent_dtype: torch.dtype | None = None) -> int:
        element = (latent_dtype or dtype).itemsize
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element


def _stack_right_padded(caches: list[MLACache]) -> torch.Tensor:
    """`[B, longest, dims]` fp32: each cache's latents, zeros after each (one copy from the caches;
    none for one cache that holds fp32)."""
    if len(caches) == 1:
        return caches[0].latents(torch.float32)[None]
    first = caches[0].buffer
    out = first.new_zeros(len(caches), max(c.length for c in caches), first.shape[1], dtype=torch.float32)
    for b, cache in enumerate(caches):
        cache.read_into(out[b, :cache.length])
    return out


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
        # torch threads for a prompt's attention of WIDE_ATTENTION_SCORES or more, asked at each one
        # (`KimiLinearForCausalLM.set_attention_threads`); None: the trunk's own
        self.attention_threads: Callable[[], int] | None = None

    def forward(self, x: torch.Tensor, segments: Segments, caches: list[MLACache] | None = None) -> torch.Tensor:
        """x `[1, N, hidden]`: the new tokens of `segments`' sequences end to end, which continue
        `caches` (one per sequence, appended to) or, without caches, are whole sequences."""
        H, N = self.num_heads, x.shape[1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(1, N, H, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)[0]  # [N, dims]
        w_kv = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        attn = x.new_empty(1, N, H, self.v_dim, dtype=torch.float32)
        if segments.singles:
            at = segments.single_positions
            mine = [caches[b] for b in segments.singles]
            for cache, row in zip(mine, latent[at], strict=True):
                cache.append(row[None])
            keys = _stack_right_padded(mine)
            attn[0, at] = self._absorbed(q_nope[0, at][:, None], q_rope[0, at][:, None], keys, segments.single_starts,
                                         w_kv)[:, 0]
        for b in segments.others:
            span = segments.span(b)
            start = 0
            keys = latent[span]
            if caches is not None:
                start = caches[b].length
                caches[b].append(keys)
                keys = caches[b].latents(x.dtype)
            attn[:, span] = self._expanded(q_nope[:, span], q_rope[:, span], keys[None], start, segments)
        gate = torch.sigmoid(self.g_proj(x).float()).view(1, N, H, self.v_dim)
        return self.o_proj((attn * gate).reshape(1, N, H * self.v_dim).to(x.dtype))

    def _absorbed(self, q_nope, q_rope, latent, starts, w_kv) -> torch.Tensor:
        """One new token per sequence (row b at position starts[b]), in latent space: `[B, 1, H, v]`;
        each row sees its own keys only (latent, fp32, is right-padded to the longest)."""
        c_all, k_rot_all = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope.float(), w_kv[:, :self.nope].float())
        scores = torch.einsum("bthc,bsc->bhts", q_lat, c_all)
        scores = scores + torch.einsum("bthr,bsr->bhts", q_rope.float(), k_rot_all)
        visible = torch.arange(latent.shape[1], device=latent.device)[None] <= starts[:, None]  # [B, S]
        scores = (scores * self.scale).masked_fill(~visible[:, None, None], float("-inf"))
        o_lat = torch.einsum("bhts,bsc->bthc", torch.softmax(scores, dim=-1), c_all)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_kv[:, self.nope:].float())

    def _expanded(self, q_nope, q_rope, latent, start: int, segments: Segments) -> torch.Tensor:
        """One sequence's T tokens (positions start .. start + T) through SDPA: `[1, T, H, v]`. A
        whole sequence (start 0) in one causal call; a chunk after a prefix QUERY_CHUNK queries at a
        time, each block with its own `[block, S]` mask (SDPA's `is_causal` aligns the diagonal to
        the first key, not the last).

        The value is zero-padded to the query/key width: the CPU flash kernel (and CUDA's) takes
        one head size for q, k and v, and otherwise falls back to the kernel that builds the scores."""
        _, T, H = q_nope.shape[:3]
        S = latent.shape[1]
        c_all, k_rot_all = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(c_all).view(1, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        width = self.nope + self.rope
        q = torch.cat([q_nope, q_rope], dim=-1).float().transpose(1, 2)  # [1, H, T, width]
        k = torch.cat([k_nope, k_rot_all[:, :, None].expand(1, S, H, self.rope)], dim=-1).float().transpose(1, 2)
        v = F.pad(v.float(), (0, width - self.v_dim)).transpose(1, 2)
        with self._threads(H * T * (start + (T + 1) / 2)):
            if start == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                out = q.new_empty(1, H, T, width)
                for first in range(0, T, QUERY_CHUNK):
                    last = min(T, first + QUERY_CHUNK)
                    seen = start + last  # no query of this block sees a key beyond this one
                    mask = segments.chunk_mask(start, first, last, q.dtype)  # additive: faster than bool
                    out[:, :, first:last] = F.scaled_dot_product_attention(
                        q[:, :, first:last], k[:, :, :seen], v[:, :, :seen], attn_mask=mask, scale=self.scale)
        return out[..., :self.v_dim].transpose(1, 2)

    @contextlib.contextmanager
    def _threads(self, scores: float) -> Iterator[None]:
        """Run the block on `attention_threads()` torch threads when it computes `scores` query-key
        scores or more, then go back to the trunk's own count."""
        own = torch.get_num_threads()
        wide = self.attention_threads() if self.attention_threads and scores >= WIDE_ATTENTION_SCORES else own
        if wide == own:
            yield
            return
        torch.set_num_threads(wide)
        try:
            yield
        finally:
            torch.set_num_threads(own)
