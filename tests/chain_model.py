"""A trunk rewired to write a fixed chain of tokens greedily: deterministic replies for the tests
of what the faces make of a generation (stop strings, n, logprobs, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from textcore.model import KimiLinearForCausalLM
from textcore.tokenizer import SEP_ID


def chain_model(checkpoint: Path, chain: Sequence[int], start: int = SEP_ID) -> KimiLinearForCausalLM:
    """The checkpoint's trunk (float32) that, after `start` (the generation prompt's last token),
    writes chain[0], then chain[1], ...: greedy decoding follows each token to its successor.

    Every weight inside the decoder layers is zeroed (MXFP4 codes too), so no layer adds anything
    and the last position's final hidden state is a positive multiple of its token embedding
    (Attention Residuals mix the embedding checkpoint with zero sums). Token k of [start, *chain]
    is embedded as channel k alone; the final norm keeps those channels; the head scores chain[k]
    on channel k, and nothing else anywhere (every other logit is 0)."""
    tokens = [start, *chain]
    model = KimiLinearForCausalLM.from_checkpoint(checkpoint, dtype=torch.float32)
    if len(set(tokens[:-1])) != len(tokens) - 1 or len(tokens) - 1 > model.cfg.hidden_size:
        raise ValueError(f"a chain needs distinct tokens (its last may repeat), at most {model.cfg.hidden_size}")
    with torch.no_grad():
        for t in [*model.model.layers.parameters(), *model.model.layers.buffers()]:
            t.zero_()
        norm = model.model.norm.weight
        norm.zero_()
        norm[:len(tokens) - 1] = 1
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for k, (token, successor) in enumerate(zip(tokens, tokens[1:], strict=False)):
            emb[token].zero_()
            emb[token, k] = 1.0
            head[successor, k] = 1.0
    return model
