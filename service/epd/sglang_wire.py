"""What SGLang 0.5.23's language side receives from an encoder over ZMQ (`zmq_to_scheduler`,
`zmq_to_tokenizer`): one message per part of an encode request, of two frames, a pickled
`EmbeddingData` and the part's rows as raw bytes (the pickle alone when the part failed).

The pickle is what SGLang's receiver unpickles with its allow-list (`SafeUnpickler` in
sglang/srt/utils/common.py): an instance of `sglang.srt.disaggregation.encoder.receiver.EmbeddingData`
holding the attributes its encoder sends (`EmbeddingData.copy_without_embedding`, in the order its
`__init__` sets them): `req_id`, `num_parts`, `part_idx`, `grid_dim` (int64 tensor, one `[t, h, w]`
row per image), `modality` (SGLang's `Modality`, mapped from the item's by `WIRE_MODALITY`),
`embedding` (None: the rows are the second frame), `send_time`, `dtype` (torch.bfloat16), `shape`
([rows, hidden]), `_mr_ptr`, `error_msg`, `error_code`, then the aux data its Kimi-K3 encoder adds
(`video_timestamps`, `second_per_grid_ts`: None; `original_image_sizes`: one `[width, height]` per
image, which K3's SGLang processor writes into the prompt). A failed part carries `error_msg` and `error_code` (the
HTTP status) and no grid, dtype or shape; the receiver then fails the request at once.

SGLang is never imported: the two SGLang class names are written into the pickle by name
(`_WirePickler`), and everything else is pickled as Python and torch pickle it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch

from vision.media import Modality

SGLANG_VERSION = "0.5.23"
ROW_DTYPE = torch.bfloat16  # what SGLang's Kimi-K3 language model runs in (its encoder sends its param dtype)
PICKLE_PROTOCOL = 4  # the first with STACK_GLOBAL; SGLang's encoder pickles with Python's default (4 or 5)


class _EmbeddingData:
    """Pickles as SGLang's EmbeddingData with exactly this instance's attributes."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _Modality(Enum):  # sglang.srt.multimodal.modality.Modality: IMAGE, VIDEO, AUDIO = auto()
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


# SGLang's name of each of our modalities, both ways: the request's `modality` field is its name.
WIRE_MODALITY = {Modality.IMAGE: _Modality.IMAGE, Modality.VIDEO: _Modality.VIDEO}
MODALITY_NAMES = {wire.name: ours for ours, wire in WIRE_MODALITY.items()}


_WIRE_NAMES = {_EmbeddingData: ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
               _Modality: ("sglang.srt.multimodal.modality", "Modality")}


class _WirePickler(pickle._Pickler):
    """Python's own pickler, writing the two stand-in classes under SGLang's names (the C pickler
    insists on importing a class it names, and SGLang is not here)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        wire = _WIRE_NAMES.get(obj)
        if wire is None:
            super().save_global(obj, name)
            return
        module, qualname = wire
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def _pickled(state: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    _WirePickler(out, PICKLE_PROTOCOL).dump(_EmbeddingData(state))
    return out.getvalue()


def _head(req_id: str, num_parts: int, part_idx: int, grid: torch.Tensor | None,
          modality: Modality) -> dict[str, Any]:
    return {"req_id": req_id, "num_parts": num_parts, "part_idx": part_idx, "grid_dim": grid,
            "modality": WIRE_MODALITY[modality], "embedding": None, "send_time": None}


def part_frames(req_id: str, num_parts: int, part_idx: int, modality: Modality, rows: torch.Tensor,
                grids: Sequence[tuple[int, int, int]], sizes: Sequence[tuple[int, int]]) -> list[Any]:
    """The message for one encoded part: its images' rows ([tokens, hidden], ROW_DTYPE, in image
    order), each image's grid and original (width, height)."""
    if rows.dtype != ROW_DTYPE or rows.dim() != 2:
        raise ValueError(f"a part's rows are [tokens, hidden] {ROW_DTYPE}, got {tuple(rows.shape)} {rows.dtype}")
    if len(grids) != len(sizes):
        raise ValueError(f"{len(grids)} grids but {len(sizes)} image sizes")
    rows = rows.contiguous()
    state = _head(req_id, num_parts, part_idx, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3), modality)
    state.update(dtype=rows.dtype, shape=list(rows.shape), _mr_ptr=None, error_msg=None, error_code=None,
                 video_timestamps=None, second_per_grid_ts=None, original_image_sizes=[list(s) for s in sizes])
    return [_pickled(state), memoryview(rows.view(torch.uint8).numpy())]


def error_frames(req_id: str, num_parts: int, part_idx: int, modality: Modality, message: str,
                 status: int) -> list[bytes]:
    """The message for a part that failed: SGLang's receiver fails the whole request on it."""
    state = _head(req_id, num_parts, part_idx, None, modality)
    state.update(dtype=None, shape=None, _mr_ptr=None, error_msg=message, error_code=int(status))
    return [_pickled(state)]
