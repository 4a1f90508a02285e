"""The sequences of one trunk forward, laid end to end.

A forward runs the new tokens of several sequences at once as one flat `[1, N, hidden]` row:
sequence b's tokens are positions `offsets[b] .. offsets[b + 1]`. Everything per token (the
projections, norms, Attention Residuals, the MoE with all N tokens in one call) runs on the flat
row; only attention is per sequence. With caches, the sequences of one new token each (decode)
are attended together (`singles`: KDA's recurrent step on their stacked states, MLA's absorbed
form over their latents); every other sequence (a prompt chunk, or a whole sequence without a
cache) on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class Segments:
    """`lengths[b]` new tokens of sequence b; `past[b]` tokens its cache holds before them (None:
    no caches, each sequence is whole)."""

    def __init__(self, lengths: Sequence[int], past: Sequence[int] | None, device: torch.device | str):
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every sequence of a forward needs at least one token; got lengths {list(lengths)}")
        if past is not None and len(past) != len(lengths):
            raise ValueError(f"{len(past)} cache lengths for {len(lengths)} sequences")
        self.lengths = list(lengths)
        self.device = device
        self.offsets = [0, *itertools.accumulate(self.lengths)]
        self.cached = past is not None
        self.singles = [b for b, n in enumerate(self.lengths) if self.cached and n == 1]
        self.others = [b for b, n in enumerate(self.lengths) if not (self.cached and n == 1)]
        # made once per forward, for every layer: where the singles' tokens sit in the row, and at
        # which position of its sequence each one is (the tokens before it)
        self.single_positions = torch.tensor([self.offsets[b] for b in self.singles], dtype=torch.long, device=device)
        self.single_starts = torch.tensor([past[b] for b in self.singles] if past is not None else [],
                                          dtype=torch.long, device=device)
        self._chunk_masks: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}

    def chunk_mask(self, start: int, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask `[last - first, start + last]` of a chunk's queries `first .. last`
        (positions `start + first ..`, after `start` cached tokens) over the keys they may see:
        made once per forward, for every MLA layer. Only the block's own keys lie in a query's
        future, so past the zero fill just a `[block, block]` triangle is written."""
        key = (start, first, last, dtype)
        if key not in self._chunk_masks:
            block = last - first
            mask = torch.zeros(block, start + last, dtype=dtype, device=self.device)
            mask[:, start + first:].masked_fill_(torch.ones(block, block, dtype=torch.bool, device=self.device).triu(1),
                                                 float("-inf"))
            self._chunk_masks[key] = mask
        return self._chunk_masks[key]

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def span(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b + 1])

    def last_positions(self) -> list[int]:
        return [end - 1 for end in self.offsets[1:]]
