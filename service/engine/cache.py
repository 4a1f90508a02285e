"""Content-hash cache of image embeddings, bounded in bytes, least recently used evicted first.

The key (`service.engine.identity.content_hash`) covers everything that decides the embedding:
the image bytes, the preprocessing options, and the checkpoint's fingerprint.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

import torch


class HasRows(Protocol):
    rows: torch.Tensor


V = TypeVar("V", bound=HasRows)


class EmbedCache(Generic[V]):
    """Thread-safe LRU of `content_hash -> value`, holding at most `max_bytes` of tensor data.

    Values hold a `rows` tensor (the engine's `ImageEmbedding`); their size is that tensor's
    bytes. An entry larger than the whole budget is not stored; `max_bytes == 0` disables the cache.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, value: V) -> None:
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
