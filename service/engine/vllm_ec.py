"""vLLM's encoder cache, from the producer's side: the key vLLM looks an image up by, and the file.

vLLM's shared-storage encoder-cache connector (`ECExampleConnector`, encoder disaggregation)
loads `<dir>/<mm_hash>/encoder_cache.safetensors` and takes its single tensor `ec_cache`
([num_tokens, hidden_size]) as the encoder output of the multimodal item whose hash is `mm_hash`.
So a file is found only under the `mm_hash` vLLM itself computes for the image, which `mm_hash`
below reproduces (vLLM 0.33, `vllm/multimodal/hasher.py`; checked against goldens vLLM computed,
tests/test_vllm_hash.py): the digest (blake3 by default) of a self-delimiting stream of the
keyword items `image` (the original encoded bytes, as received) and `model_id` (the model string
the vLLM instance was started with). A client's own item `uuid` replaces the hash verbatim.

An encoder also reports, in its chat response, what the proxy needs to reference each image instead
of sending it (`transfer_params`: vLLM's `collect_ec_item_metadata`).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import save_file

from service.files import atomic_path

DEFAULT_MODEL_ID = "moonshotai/Kimi-K3"  # what `vllm serve` is given for the release
HASH_ALGORITHMS = ("blake3", "sha256", "sha512")  # vLLM's --mm-hasher-algorithm (blake3 its default)
FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
_HASH = re.compile(r"^[0-9a-zA-Z_-]{1,128}$")
_PLAIN = b"\x03"  # the framing's tag of a plain value (None 0x00, sequence 0x01, mapping 0x02)


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data  # u64 little-endian byte count, then the bytes


def _framed(data: bytes, model_id: str) -> Iterator[bytes]:
    """The chunks vLLM feeds its digest: the keyword items in sorted name order (`image`,
    `model_id`), each as its name, the plain-value tag and the value; the image item is itself a
    nested (name `image`, tag, original bytes) pair."""
    yield from (_length_prefixed(b"image"), _PLAIN, _length_prefixed(b"image"), _PLAIN, _length_prefixed(data))
    yield from (_length_prefixed(b"model_id"), _PLAIN, _length_prefixed(model_id.encode()))


def mm_hash(data: bytes, model_id: str, algorithm: str = "blake3") -> str:
    """vLLM's `mm_hash` of an image reaching its OpenAI server as `data` (for a `data:` URL: the
    decoded payload), under `model_id`: lowercase hex (64 chars; 128 for sha512)."""
    if algorithm not in HASH_ALGORITHMS:
        raise ValueError(f"hash algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
    digest = blake3.blake3() if algorithm == "blake3" else hashlib.new(algorithm)
    for chunk in _framed(bytes(data), model_id):
        digest.update(chunk)
    return digest.hexdigest()


def item_key(data: bytes, uuid: str | None, model_id: str, algorithm: str = "blake3") -> str:
    """The key vLLM files an image under: the client's `uuid` verbatim when it sent one, else `mm_hash`."""
    return uuid if uuid is not None else mm_hash(data, model_id, algorithm)


def ec_path(directory: str | Path, mm_hash: str) -> Path:
    if not _HASH.match(mm_hash):
        raise ValueError(f"not a usable encoder-cache hash: {mm_hash!r}")
    return Path(directory) / mm_hash / FILE_NAME


def write_ec(directory: str | Path, mm_hash: str, embedding: torch.Tensor) -> Path:
    """Write one item's embedding atomically (`service.files.atomic_path`): a reader never sees half
    a file. Not durably (`durable=False`): this runs per image on the Encode / EC producer request
    path, one after another before the reply, where a file fsync and a directory fsync each would
    wait on the disk; the export needs the rename, not the file to outlive a power loss."""
    if embedding.dim() != 2:
        raise ValueError(f"an encoder-cache entry is [num_tokens, hidden], got shape {tuple(embedding.shape)}")
    target = ec_path(directory, mm_hash)
    with atomic_path(target, durable=False) as tmp:
        save_file({TENSOR_NAME: embedding.detach().to("cpu").contiguous()}, str(tmp))
    return target


def transfer_params(keys: Sequence[str], grids: Sequence[tuple[int, int, int]]) -> dict[str, dict[str, Any]]:
    """A producer's `ec_transfer_params`, in vLLM's schema (`collect_ec_item_metadata`,
    vllm/distributed/ec_transfer/ec_connector/utils.py): per key, in first-seen order, the modality,
    the positions of the request's images filed under it (`item_indices`), and the placeholder
    metadata, K3's `grid_thws` of the image ([t, h, w] patches: h * w / 4 tokens), which vLLM's proxy
    turns into an `image_embeds` reference for the decoder."""
    params: dict[str, dict[str, Any]] = {}
    for index, (key, grid) in enumerate(zip(keys, grids, strict=True)):
        entry = params.setdefault(key, {"modality": "image", "item_indices": []})
        entry["metadata"] = {"grid_thws": list(grid)}
        entry["item_indices"].append(index)
    return params
