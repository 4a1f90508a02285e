"""Write image embeddings in the layout of vLLM's shared-storage encoder-cache connector.

That connector (encoder disaggregation) loads `<dir>/<mm_hash>/encoder_cache.safetensors` and
takes its single tensor `ec_cache` ([num_tokens, hidden_size]) as the encoder output of the
multimodal item whose hash is `mm_hash`. The engine names the folder by its `content_hash`; a
consumer must look items up by that hash (vLLM's own hasher computes a different one).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
_HASH = re.compile(r"^[0-9a-zA-Z_-]{1,128}$")


def ec_path(directory: str | Path, mm_hash: str) -> Path:
    if not _HASH.match(mm_hash):
        raise ValueError(f"not a usable encoder-cache hash: {mm_hash!r}")
    return Path(directory) / mm_hash / FILE_NAME


def write_ec(directory: str | Path, mm_hash: str, embedding: torch.Tensor) -> Path:
    """Write one item's embedding; atomic (temp file + rename), so a reader never sees half a file."""
    if embedding.dim() != 2:
        raise ValueError(f"an encoder-cache entry is [num_tokens, hidden], got shape {tuple(embedding.shape)}")
    target = ec_path(directory, mm_hash)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ec_cache.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_file({TENSOR_NAME: embedding.detach().to("cpu").contiguous()}, tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
