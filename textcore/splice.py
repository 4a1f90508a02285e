"""Chat with images -> the trunk's input: expanded ids, position ids, and spliced embeddings.

The chat template puts one `<|media_pad|>` in each image's prompt
(`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`). At embedding time
each media_pad stands for `num_tokens` projector rows (docs/MODEL.md §6). We pre-expand: the
k-th media_pad becomes `num_tokens[k]` media_pad ids, so the expanded id sequence has one id per
trunk input row. That is also the form a downstream engine prefills (`Encode`). Position ids are
re-laid after the expansion as `cumsum(attention_mask) - 1`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from textcore.chat import ChatError, render
from textcore.tokenizer import MEDIA_PAD_ID, Tokenizer


class Span(NamedTuple):
    """Rows `offset .. offset + length` of the expanded sequence belong to one image."""

    offset: int
    length: int


class Expanded(NamedTuple):
    input_ids: list[int]
    spans: list[Span]


class SpliceError(ChatError):
    """The prompt's media_pad ids and the images do not line up (a chat whose image parts and
    images disagree)."""


def prompt_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], tools: Any, image_prompts: Sequence[str],
               **chat_kwargs: Any) -> list[int]:
    """Render the chat with each image part replaced by its prompt and encode it (one media_pad per image)."""
    return tokenizer.encode_segments(render(messages, tools, image_prompts=list(image_prompts), **chat_kwargs))


def expand_media_pads(ids: Sequence[int], image_tokens: Sequence[int], media_pad_id: int = MEDIA_PAD_ID) -> Expanded:
    """Replace the k-th media_pad in `ids` by `image_tokens[k]` media_pads; spans locate each image."""
    pads = [i for i, token in enumerate(ids) if token == media_pad_id]
    if len(pads) != len(image_tokens):
        raise SpliceError(f"the prompt holds {len(pads)} media_pad tokens but {len(image_tokens)} images were given")
    out: list[int] = []
    spans: list[Span] = []
    start = 0
    for pad, n in zip(pads, image_tokens, strict=True):
        if n < 1:
            raise SpliceError(f"an image needs at least one token, got {n}")
        out.extend(ids[start:pad])
        spans.append(Span(len(out), n))
        out.extend([media_pad_id] * n)
        start = pad + 1
    out.extend(ids[start:])
    return Expanded(out, spans)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """`cumsum(mask) - 1` along the last axis; padded (mask 0) positions get 0."""
    mask = attention_mask.to(torch.long)
    return (mask.cumsum(-1) - 1).clamp_min(0) * mask


def splice_rows(text_embeds: torch.Tensor, spans: Sequence[Span], image_rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy of `text_embeds` ([T, hidden], the embedding of the expanded ids) with each span's rows
    replaced by its image's projector output ([length, hidden])."""
    if len(spans) != len(image_rows):
        raise SpliceError(f"{len(spans)} image spans but {len(image_rows)} embeddings")
    out = text_embeds.clone()
    for span, rows in zip(spans, image_rows, strict=True):
        if rows.shape != (span.length, out.shape[-1]):
            raise SpliceError(f"image rows of shape {tuple(rows.shape)} do not fit a span of "
                              f"{span.length} x {out.shape[-1]}")
        out[span.offset:span.offset + span.length] = rows.to(device=out.device, dtype=out.dtype)
    return out
