"""vLLM's shared-storage encoder-cache transport, from the producer's side: the key vLLM looks an
item up by, the file, and what the producer's reply tells the proxy (`VllmStorageSink`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import save_file

from service.engine import Encoding, Engine, MediaInput
from service.engine.config import HASH_ALGORITHMS
from service.epd.base import Delivery, Sink
from service.errors import NotConfigured
from service.files import atomic_path
from vision.media import Modality

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


def item_keys(media: Sequence[MediaInput], model_id: str, algorithm: str) -> list[str]:
    """Each item's key (blocking: it hashes the bytes; run it off the event loop)."""
    return [item_key(item.data, item.uuid, model_id, algorithm) for item in media]


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


def transfer_params(keys: Sequence[str], modalities: Sequence[Modality],
                    grids: Sequence[tuple[int, int, int]]) -> dict[str, dict[str, Any]]:
    """A producer's `ec_transfer_params`, in vLLM's schema (`collect_ec_item_metadata`,
    vllm/distributed/ec_transfer/ec_connector/utils.py): per key, in first-seen order, the item's
    modality, the positions of the request's items filed under it (`item_indices`), and the
    placeholder metadata, K3's `grid_thws` of the item ([t, h, w] patches: h * w / 4 tokens), which
    vLLM's proxy turns into an `image_embeds` reference for the decoder."""
    params: dict[str, dict[str, Any]] = {}
    for index, (key, modality, grid) in enumerate(zip(keys, modalities, grids, strict=True)):
        entry = params.setdefault(key, {"modality": modality.value, "item_indices": []})
        entry["metadata"] = {"grid_thws": list(grid)}
        entry["item_indices"].append(index)
    return params


@dataclass(frozen=True)
class VllmStorageSink(Sink):
    """Each item's rows, cast to `dtype` (vLLM's activation dtype for K3, bf16), written under
    `directory` by the key vLLM computes for it; the delivery's transfer params are vLLM's."""

    directory: Path
    model_id: str
    algorithm: str
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def of(cls, engine: Engine, dtype: torch.dtype = torch.bfloat16) -> VllmStorageSink:
        """The engine's export directory (`--ec-export-dir`), model id and hash algorithm."""
        directory = engine.config.ec_export_dir
        if directory is None:
            raise NotConfigured("exporting vLLM encoder-cache files needs the server to run with --ec-export-dir")
        return cls(Path(directory), engine.model_id, engine.config.hash_algorithm, dtype)

    def write(self, encoding: Encoding) -> Delivery:
        """Blocking: run it off the event loop (`Engine.run_cpu`)."""
        keys = item_keys(encoding.media, self.model_id, self.algorithm)
        paths = [str(write_ec(self.directory, key, e.rows.to(self.dtype)))
                 for key, e in zip(keys, encoding.embeddings, strict=True)]
        params = transfer_params(keys, [item.modality for item in encoding.media],
                                 [e.grid_thw for e in encoding.embeddings])
        return Delivery(params, paths, keys)

    async def deliver(self, engine: Engine, encoding: Encoding, destination: None = None) -> Delivery:
        return await engine.run_cpu(self.write, encoding)
