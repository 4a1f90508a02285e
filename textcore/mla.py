"""Gated multi-head latent attention without RoPE (K3's global layers).

    q = q_b(RMSNorm_qlora(q_a(x)))                  -> heads x [nope | rope]
    [c_kv | k_rot] = kv_a_proj_with_mqa(x);  c = RMSNorm_kvlora(c_kv)
    [k_nope | v] = kv_b(c)                          -> heads x [nope | v]
    score = (q_nope . k_nope + q_rope . k_rot) * (nope + rope)^-0.5, causal softmax in fp32
    out = o_proj(attn * sigmoid(g_proj(x)))

k_rot is one key shared by all heads and is never rotated (mla_use_nope). The cache holds only
the per-token latent [c | k_rot] (kv_lora_rank + rope dims), in the fixed-size blocks of a
`LatentPool`; each sequence names its blocks in a `BlockTable`, and attention reads a sequence's
latents by gathering its blocks. A prompt (T > 1) is attended in the expanded form through
`scaled_dot_product_attention` (flash kernels on CPU and CUDA): a whole prompt in one causal call,
a chunk that continues a cached prefix one block of QUERY_CHUNK queries at a time with that
block's mask only. Memory grows linearly with the
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
import itertools
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
# Tokens a block of the latent pool holds (vLLM's default): small enough that a sequence holds at
# most one partly filled block, large enough that a gather moves whole runs of rows
BLOCK_SIZE = 16
_table_serials = itertools.count()  # BlockTable.key
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


class OutOfBlocks(RuntimeError):
    """A `LatentPool` at its `num_blocks` has fewer free blocks than a sequence asked for."""


class LatentPool:
    """The MLA latents of many sequences in fixed-size blocks: `storage` `[layers, blocks,
    block_size, dims]`, one block id covering `block_size` tokens of every MLA layer, handed out by
    `allocate` and returned by `free`. `num_blocks` bounds it (the scheduler's budget: `allocate`
    raises `OutOfBlocks` past it; None: no bound, a sequence or batch of its own). It is allocated
    whole at once with `preallocate` (a GPU's, as vLLM does: the memory is the server's from the
    start), else it grows by doubling as blocks are taken (the storage copied), so the memory it
    holds follows the tokens held: on a CPU, where every mapped byte counts against the host's
    commit, a budget not yet needed is not taken."""

    def __init__(self, layers: int, dims: int, dtype: torch.dtype, *, latent_dtype: torch.dtype | None = None,
                 num_blocks: int | None = None, preallocate: bool = False, block_size: int = BLOCK_SIZE,
                 device: torch.device | str = "cpu") -> None:
        if latent_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"MLA latent cache dtype must be the model dtype or float8_e4m3fn, not {latent_dtype}")
        self.fp8 = latent_dtype == torch.float8_e4m3fn
        if self.fp8:
            _warn_fp8_once()
        self.block_size = block_size
        self.limit = num_blocks
        self.storage = torch.empty(layers, num_blocks if preallocate and num_blocks else 0, block_size, dims,
                                   dtype=latent_dtype or dtype, device=device)
        self._free = list(range(self.allocated - 1, -1, -1))  # popped from the end: lowest ids first
        self._tables: tuple[tuple, torch.Tensor] | None = None  # `_stack_right_padded`'s, for every layer of a step

    @property
    def num_blocks(self) -> int:
        """The blocks it may hold: its bound, or (without one) those it has."""
        return self.allocated if self.limit is None else self.limit

    @property
    def allocated(self) -> int:
        """The blocks its storage has now."""
        return self.storage.shape[1]

    @property
    def allocated_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self.allocated

    @property
    def block_bytes(self) -> int:
        """One block: `block_size` tokens' latents in every MLA layer."""
        layers, _, size, dims = self.storage.shape
        return layers * size * dims * self.storage.element_size()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if self.limit is not None and count > self.num_free:
            raise OutOfBlocks(f"{count} blocks asked of a pool with {self.num_free} free")
        if count > len(self._free):
            grown = max(2 * self.allocated, self.allocated + count - len(self._free))
            self._grow(grown if self.limit is None else min(grown, self.limit))
        taken = self._free[len(self._free) - count:][::-1]
        del self._free[len(self._free) - count:]
        if taken:  # rows a sequence has not written yet hold zeros, never the garbage of torch.empty
            self.storage[:, torch.tensor(taken, device=self.storage.device)] = 0
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def _grow(self, blocks: int) -> None:
        grown = self.storage.new_empty(self.storage.shape[0], blocks, *self.storage.shape[2:])
        grown[:, :self.allocated] = self.storage
        self._free = list(range(blocks - 1, self.allocated - 1, -1)) + self._free
        self.storage = grown

    def store(self, latent: torch.Tensor) -> torch.Tensor:
        """`latent` as the storage holds it (fp8: scaled and saturated)."""
        if self.fp8:
            return (latent.float() / FP8_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return latent.to(self.storage.dtype)

    def load(self, held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows back in `dtype`."""
        return (held.float() * FP8_SCALE).to(dtype) if self.fp8 else held.to(dtype)

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype, latent_dtype: torch.dtype | None = None) -> int:
        """One token's latents in one MLA layer."""
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (latent_dtype or dtype).itemsize


class BlockTable:
    """One sequence's blocks of a `LatentPool`, in order: token t lies in block `blocks[t // block_size]`
    at row `t % block_size`, in every MLA layer."""

    def __init__(self, pool: LatentPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        # which table, in which state: (a serial never reused, a count of its changes), what the
        # tensors made from its blocks are keyed by
        self.key = (next(_table_serials), 0)
        self._tensor: tuple[tuple[int, int], torch.Tensor] | None = None

    def reserve(self, tokens: int) -> None:
        """Blocks for `tokens` tokens in all (`OutOfBlocks` from a pool at its bound without them)."""
        short = self.pool.blocks_for(tokens) - len(self.blocks)
        if short > 0:
            self.blocks += self.pool.allocate(short)
            self.key = (self.key[0], self.key[1] + 1)

    def release(self) -> None:
        self.pool.free(self.blocks)
        self.blocks = []
        self.key = (self.key[0], self.key[1] + 1)

    def tensor(self) -> torch.Tensor:
        """The block ids on the pool's device (made again only when the blocks changed)."""
        if self._tensor is None or self._tensor[0] != self.key:
            self._tensor = self.key, torch.tensor(self.blocks, dtype=torch.long, device=self.pool.storage.device)
        return self._tensor[1]

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Where tokens `start .. end` lie in a layer's storage viewed as `[blocks * block_size, dims]`."""
        size = self.pool.block_size
        positions = torch.arange(start, end, device=self.pool.storage.device)
        return self.tensor()[positions // size] * size + positions % size


class MLACache:
    """One sequence's latents in one MLA layer (`slot` of the pool's layers): the first `length`
    tokens of its `BlockTable`. Appending takes the blocks the new rows need (a scheduler reserved
    them before the step; outside one, an unbounded pool hands them out here)."""

    def __init__(self, table: BlockTable, slot: int) -> None:
        self.table = table
        self.slot = slot
        self.length = 0

    def _flat(self) -> torch.Tensor:
        storage = self.table.pool.storage
        return storage[self.slot].view(-1, storage.shape[-1])

    def append(self, latent: torch.Tensor) -> None:
        """Store `latent` `[T, dims]` after the rows already held."""
        end = self.length + latent.shape[0]
        self.table.reserve(end)
        self._flat()[self.table.rows(self.length, end)] = self.table.pool.store(latent)
        self.length = end

    def latents(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows held, `[length, dims]`, as read back from the cache, in `dtype` (a gather of the
        sequence's blocks)."""
        pool = self.table.pool
        held = pool.storage[self.slot][self.table.tensor()[:pool.blocks_for(self.length)]]
        return pool.load(held.reshape(-1, held.shape[-1])[:self.length], dtype)


def _append_rows(caches: list[MLACache], rows: torch.Tensor) -> None:
    """One new row per cache (a decode step): one write for the caches of one pool."""
    first = caches[0]
    pool = first.table.pool
    if any(c.table.pool is not pool or c.slot != first.slot for c in caches):
        for cache, row in zip(caches, rows, strict=True):
            cache.append(row[None])
        return
    for cache in caches:
        cache.table.reserve(cache.length + 1)
    size = pool.block_size
    at = [c.table.blocks[c.length // size] * size + c.length % size for c in caches]
    first._flat()[torch.tensor(at, device=rows.device)] = pool.store(rows)
    for cache in caches:
        cache.length += 1


def _stack_right_padded(caches: list[MLACache]) -> torch.Tensor:
    """`[B, longest, dims]` fp32: each cache's latents; past each one's length, finite values the
    caller masks (zeros, or rows of its own blocks: a block is zeroed when it is taken). For caches
    of one pool, one gather of their blocks, by a table made once for every layer of the step."""
    if len(caches) == 1:
        return caches[0].latents(torch.float32)[None]
    first = caches[0]
    pool = first.table.pool
    longest = max(c.length for c in caches)
    if any(c.table.pool is not pool or c.slot != first.slot for c in caches):
        out = torch.zeros(len(caches), longest, pool.storage.shape[-1], device=pool.storage.device)
        for b, cache in enumerate(caches):
            out[b, :cache.length] = cache.latents(torch.float32)
        return out
    wide = pool.blocks_for(longest)
    key = (wide, *(c.table.key for c in caches))
    if pool._tables is None or pool._tables[0] != key:
        rows = [c.table.blocks[:wide] + [c.table.blocks[0]] * (wide - len(c.table.blocks)) for c in caches]
        pool._tables = key, torch.tensor(rows, dtype=torch.long, device=pool.storage.device)
    held = pool.storage[first.slot][pool._tables[1]]  # [B, wide, block_size, dims]
    return pool.load(held.reshape(len(caches), -1, held.shape[-1])[:, :longest], torch.float32)


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
            _append_rows(mine, latent[at])
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
