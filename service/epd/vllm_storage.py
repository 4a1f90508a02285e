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

Whoever can reach the producer names keys, so an entry is shared by every client: what keeps one
client from replacing or pre-seeding the embeddings another's request will load (docs/EPD.md, "Who
may name an entry"):

- An entry is never replaced: the first writer's file stays (`service.files.atomic_path` with
  `replace=False`: of two racing writers exactly one links its file in). The file records the
  `mm_hash` of the image it holds; a later writer of the same key with the same image gets the key
  as usual, one with another image a 400 (under a uuid a client chose, that is the only way two
  images meet one key).
- A uuid with the form of a content hash (`service.media.hash_shaped`) must be the item's own: its
  `mm_hash`, or the sha256 of the URL it came by (the key vLLM's EPD proxy sets on every image).
  Any other is a 400, so no request can take the key another image is, or will be, filed under.
- `client_uuids="content"` (`--ec-client-uuids content`) takes only such content keys: a uuid a
  client names freely (`user-item-42`) is then a 400, and every entry is bound to its image.

An encoder also reports, in its chat response, what the proxy needs to reference each image instead
of sending it (`transfer_params`: vLLM's `collect_ec_item_metadata`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from service.engine import Encoding, Engine, MediaInput
from service.engine.config import HASH_ALGORITHMS
from service.epd.base import Delivery, Sink
from service.errors import BadRequest, NotConfigured, Unavailable
from service.files import atomic_path
from service.media import UUID_RULE, hash_shaped, is_key
from vision.media import Modality

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
IMAGE_HASH = "mm_hash"  # the file's metadata entry naming the image it holds (vLLM reads the tensor alone)
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors' dtype names, as torch's
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


@dataclass(frozen=True)
class ItemKey:
    key: str  # what vLLM finds the item by: the client's uuid, else `image`
    image: str  # the item's own mm_hash, which its file records


class HasUuid(Protocol):
    """What `VllmStorageSink.check` reads of an item before its bytes are there (a face's reference)."""

    uuid: str | None
    where: str


def _key(uuid: str | None, image: str, url: str | None, where: str) -> str:
    if uuid is None:
        return image
    if not is_key(uuid):  # every face refused it already; a direct caller may not have
        raise BadRequest(f"{where}: uuid must be {UUID_RULE}, got {uuid[:60]!r}")
    if hash_shaped(uuid) and uuid != image and (url is None or uuid != hashlib.sha256(url.encode()).hexdigest()):
        raise BadRequest(f"{where}: uuid {uuid!r} has the form of a content hash but is not this image's own (its "
                         "vLLM mm_hash, or the sha256 of its URL): a hash-shaped uuid must be the item's own key")
    return uuid


def item_key(data: bytes, uuid: str | None, model_id: str, algorithm: str = "blake3", *,
             url: str | None = None, where: str = "image") -> str:
    """The key vLLM files an image under: the client's `uuid` verbatim when it sent one, else
    `mm_hash`; a hash-shaped uuid that is not the item's own (module docstring) is a BadRequest."""
    return _key(uuid, mm_hash(data, model_id, algorithm), url, where)


def item_keys(media: Sequence[MediaInput], model_id: str, algorithm: str) -> list[ItemKey]:
    """Each item's key and mm_hash (blocking: it hashes the bytes; run it off the event loop)."""
    out = []
    for item in media:
        image = mm_hash(item.data, model_id, algorithm)
        out.append(ItemKey(_key(item.uuid, image, item.url, item.where or "image"), image))
    return out


def ec_path(directory: str | Path, key: str) -> Path:
    if not is_key(key):
        raise ValueError(f"not a usable encoder-cache key ({UUID_RULE}): {key[:60]!r}")
    return Path(directory) / key / FILE_NAME


def _held(path: Path) -> tuple[str | None, str]:
    """The mm_hash an existing entry records (None: a file written without one) and its dtype."""
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get(IMAGE_HASH), str(f.get_slice(TENSOR_NAME).get_dtype())
    except (OSError, SafetensorError, KeyError) as exc:
        raise BadRequest(f"the encoder-cache entry {path.parent.name!r} exists but is not a readable "
                         f"{FILE_NAME} ({type(exc).__name__}); use another key") from None


def write_ec(directory: str | Path, key: str, embedding: torch.Tensor, image: str | None = None,
             where: str = "image") -> Path:
    """Write one item's embedding under `key`, unless the entry exists: it is never replaced (of
    two racing writers one wins). `image`: the item's mm_hash, recorded in the file; an existing
    entry recording another image, or holding another dtype, is a BadRequest (the key is taken).

    Atomically (`service.files.atomic_path`): a reader never sees half a file. Not durably
    (`durable=False`): this runs per image on the Encode / EC producer request path, one after
    another before the reply, where a file fsync and a directory fsync each would wait on the disk;
    the export needs the link, not the file to outlive a power loss."""
    if embedding.dim() != 2:
        raise ValueError(f"an encoder-cache entry is [num_tokens, hidden], got shape {tuple(embedding.shape)}")
    target = ec_path(directory, key)
    rows = embedding.detach().to("cpu").contiguous()
    try:
        with atomic_path(target, durable=False, replace=False) as tmp:
            save_file({TENSOR_NAME: rows}, str(tmp), metadata=None if image is None else {IMAGE_HASH: image})
    except OSError as exc:
        if not (isinstance(exc, FileExistsError) and target.is_file()):
            # A full, read-only or cluttered export is the operator's to mend; the request may retry.
            raise Unavailable(f"cannot write the encoder-cache entry for {where}: {exc.strerror or exc}") from None
        held, dtype = _held(target)
        ours = str(rows.dtype).removeprefix("torch.")
        if image is not None and held not in (None, image):
            taken = "another image's embeddings"
        elif _DTYPES.get(dtype) != ours:
            taken = f"{_DTYPES.get(dtype, dtype)} rows, not {ours}"
        else:
            return target
        raise BadRequest(f"{where}: the key {key!r} already holds {taken}; an entry is never replaced (the first "
                         "writer's stays): send a uuid of your own") from None
    return target
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
    `directory` by the key vLLM computes for it; the delivery's transfer params are vLLM's.
    `client_uuids`: "accept" any uuid under the module's rules, or take "content" keys only."""

    directory: Path
    model_id: str
    algorithm: str
    dtype: torch.dtype = torch.bfloat16
    client_uuids: str = "accept"

    @classmethod
    def of(cls, engine: Engine, dtype: torch.dtype = torch.bfloat16) -> VllmStorageSink:
        """The engine's export directory (`--ec-export-dir`), model id, hash algorithm and uuid rule."""
        config = engine.config
        if config.ec_export_dir is None:
            raise NotConfigured("exporting vLLM encoder-cache files needs the server to run with --ec-export-dir")
        return cls(Path(config.ec_export_dir), engine.model_id, config.hash_algorithm, dtype, config.ec_client_uuids)

    def check(self, items: Sequence[HasUuid]) -> None:
        """Before the items' bytes are read: with content keys only, a uuid that cannot be one."""
        if self.client_uuids != "content":
            return
        for item in items:
            if item.uuid is not None and not hash_shaped(item.uuid):
                raise BadRequest(f"{item.where or 'image'}: uuid {item.uuid!r} is refused: this server takes as "
                                 "uuid only an item's own content key (its vLLM mm_hash, or the sha256 of its URL, "
                                 "as vLLM's EPD proxy sets); --ec-client-uuids content")

    def keys(self, media: Sequence[MediaInput]) -> list[ItemKey]:
        """Each item's key, every rule checked (blocking: run it off the event loop, before encoding)."""
        self.check(media)
        return item_keys(media, self.model_id, self.algorithm)

    def write(self, encoding: Encoding, keys: Sequence[ItemKey]) -> Delivery:
        """Blocking: run it off the event loop (`Engine.run_cpu`)."""
        paths = [str(write_ec(self.directory, k.key, e.rows.to(self.dtype), k.image, item.where or "image"))
                 for k, e, item in zip(keys, encoding.embeddings, encoding.media, strict=True)]
        params = transfer_params([k.key for k in keys], [item.modality for item in encoding.media],
                                 [e.grid_thw for e in encoding.embeddings])
        return Delivery(params, paths, [k.key for k in keys])

    async def deliver(self, engine: Engine, encoding: Encoding, destination: Sequence[ItemKey]) -> Delivery:
        """`destination`: the items' keys, from `keys` (before the encoding)."""
        return await engine.run_cpu(self.write, encoding, destination)
