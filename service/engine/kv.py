"""The trunk's KV cache as blocks: what the scheduler admits, grows and preempts by.

One bounded `textcore.mla.LatentPool` holds the MLA latents of every sequence in 16-token blocks
(one block: 16 tokens of every MLA layer); each sequence's `SequenceCache` names its blocks in a
block table. KDA's recurrent state is fixed-size and stays each sequence's own, outside the pool;
the budget (`--kv-cache-memory-gb`) holds `max_num_seqs` of those states, and the pool is the rest.
On a GPU the pool is allocated whole at start; on a CPU it grows (by doubling) as blocks are
taken, up to that size.

The scheduler asks before each step (vLLM's v1 KVCacheManager, in small): `admits` (the blocks a
prompt needs now, plus a watermark kept free while others run, so that admitting does not at once
force a preemption), `grow` (the block a sequence's next token
needs; False: the pool is dry, preempt someone), `free` (a sequence leaves, is preempted or fails).
"""

from __future__ import annotations

import math

import torch

from textcore.model import KimiLinearForCausalLM, SequenceCache

WATERMARK = 0.01  # of the pool, kept free when admitting beside running sequences (vLLM's default)


class KVCacheManager:
    def __init__(self, model: KimiLinearForCausalLM, kv_cache_bytes: int, max_num_seqs: int,
                 latent_dtype: torch.dtype | None = None) -> None:
        self.model = model
        block_bytes = model.new_pool(0, latent_dtype).block_bytes
        states = max_num_seqs * SequenceCache.state_bytes(model.cfg)
        # a GPU's pool is the server's from the start (vLLM's way); a CPU's grows with the blocks taken
        self.pool = model.new_pool(max(0, kv_cache_bytes - states) // block_bytes, latent_dtype,
                                   preallocate=model.device.type == "cuda")
        if self.pool.num_blocks < 1:
            raise ValueError(f"a KV cache budget of {kv_cache_bytes:,} bytes holds no block of {block_bytes:,} bytes "
                             f"({self.pool.block_size} tokens) beside the KDA states of {max_num_seqs} sequences "
                             f"({states:,} bytes): raise --kv-cache-memory-gb or lower --max-num-seqs")
        self.watermark = max(1, math.ceil(WATERMARK * self.pool.num_blocks))

    @property
    def total(self) -> int:
        return self.pool.num_blocks

    @property
    def used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def block_bytes(self) -> int:
        return self.pool.block_bytes

    @property
    def allocated_bytes(self) -> int:
        """What the pool's storage takes now (all of it from the start on a GPU)."""
        return self.pool.allocated_bytes

    @property
    def max_tokens(self) -> int:
        """The most tokens one sequence can hold: the whole pool."""
        return self.pool.num_blocks * self.pool.block_size

    def blocks_for(self, tokens: int) -> int:
        return self.pool.blocks_for(tokens)

    def admits(self, blocks: int, busy: bool) -> bool:
        """Are `blocks` free, and the watermark beside them when other sequences run (`busy`)? Alone,
        a sequence may take the whole pool (else one that fits only alone would wait for ever)."""
        return blocks + (self.watermark if busy else 0) <= self.pool.num_free

    def new_cache(self, tokens: int) -> SequenceCache:
        """A sequence's cache with the blocks of its first `tokens` tokens (`admits` said they are free)."""
        cache = self.model.new_sequence(self.pool)
        cache.reserve(tokens)
        return cache

    def grow(self, cache: SequenceCache, tokens: int = 1) -> bool:
        """Blocks for `cache`'s next `tokens` tokens; False when the pool cannot give them."""
        if self.pool.blocks_for(cache.length + tokens) - len(cache.table.blocks) > self.pool.num_free:
            return False
        cache.reserve(tokens)
        return True

    def free(self, cache: SequenceCache | None) -> None:
        if cache is not None:
            cache.release()
