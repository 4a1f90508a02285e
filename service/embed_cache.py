"""Content-hash cache of image embeddings, bounded in bytes, least recently used evicted first.

The key (`content_hash`) covers everything that decides the embedding: the image bytes, the
preprocessing options, and the checkpoint's identity. The same hash is what `Embed` reports and
what the vLLM encoder-cache export uses as its folder name.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

# Bytes hashed from each weight file's start and end: enough to tell two checkpoints of the same
# shapes apart (e.g. two random seeds) without reading terabytes.
_SAMPLE_BYTES = 1 << 20


def checkpoint_identity(directory: str | Path) -> str:
    """A stable fingerprint of a checkpoint directory.

    Hashes `config.json` and, for every `*.safetensors` file (sorted by name), its name, size and
    its first and last MiB. Reading whole shards would take minutes for the real model.
    """
    root = Path(directory).resolve()
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            if size > _SAMPLE_BYTES:
                f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def content_hash(data: bytes, options_key: str, checkpoint_id: str) -> str:
    """The cache key of one image: sha256 over the checkpoint id, the preprocessing options'
    canonical string (`vision.options_key`, which carries the preprocessing version) and the bytes."""
    h = hashlib.sha256()
    h.update(checkpoint_id.encode())
    h.update(b"\0")
    h.update(options_key.encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


class EmbedCache:
    """Thread-safe LRU of `content_hash -> value`, holding at most `max_bytes` of tensor data.

    Values are anything with a `rows` tensor (the engine's `ImageEmbedding`); their size is that
    tensor's bytes. An entry larger than the whole budget is not stored; `max_bytes == 0`
    disables the cache.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, value: Any) -> None:
        rows: torch.Tensor = value.rows
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
