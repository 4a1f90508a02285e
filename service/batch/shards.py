"""Embedding output: safetensors shards beside the output JSONL (`OUT.jsonl.embeddings/`).

A safetensors file cannot be appended to, so embeddings are buffered and written a shard at a
time (`service.files.atomic_path`: temporary name, fsync, rename, directory fsync); only after a
shard is on disk are the rows that point to it appended to the output. A crash therefore loses at
most the buffered rows, which `--resume` computes again; a shard written just before a crash
without its rows is an orphan that resume deletes. Each tensor's key is its line's `custom_id`;
each row's body names its shard, key, shape and dtype (`service.batch.rows.embedding_body`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from service.batch.journal import shard_dir
from service.files import atomic_path

_SHARD_RE = re.compile(r"shard-(\d+)\.safetensors$")


class ShardWriter:
    """Buffers `(key, array, row)`; `flush()` writes one shard and hands its rows to `emit_rows`.

    Flushes by itself when the buffer reaches `max_bytes` or is `max_age_s` old.
    """

    def __init__(self, output: Path, emit_rows: Callable[[list[dict[str, Any]]], None], *,
                 max_bytes: int = 256 << 20, max_age_s: float = 30.0) -> None:
        self.root = output.parent
        self.directory = shard_dir(output)
        self.emit_rows = emit_rows
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._tensors: dict[str, np.ndarray] = {}
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0
        self._since = time.monotonic()
        existing = [int(m.group(1)) for p in self.directory.glob("shard-*.safetensors")
                    if (m := _SHARD_RE.search(p.name))] if self.directory.is_dir() else []
        self._next = max(existing, default=0) + 1

    def add(self, key: str, array: np.ndarray, row: dict[str, Any]) -> None:
        """`row`'s body names the shard (`embedding.file`, filled in when the shard is written)."""
        array = np.ascontiguousarray(array)
        if not self._tensors:
            self._since = time.monotonic()
        self._tensors[key] = array
        self._rows.append(row)
        self._bytes += array.nbytes
        if self._bytes >= self.max_bytes or time.monotonic() - self._since >= self.max_age_s:
            self.flush()

    def flush(self) -> None:
        if not self._tensors:
            return
        path = self.directory / f"shard-{self._next:05d}.safetensors"
        self._next += 1
        bodies = [r["response"]["body"] for r in self._rows]
        meta = {b["embedding"]["key"]: {"custom_id": r["custom_id"], "grid_thw": b["grid_thw"]}
                for r, b in zip(self._rows, bodies, strict=True)}
        with atomic_path(path) as tmp:
            save_file(self._tensors, str(tmp), metadata={"kimi_vision_batch": json.dumps(meta, sort_keys=True)})
        relative = path.relative_to(self.root).as_posix()
        for body in bodies:
            body["embedding"]["file"] = relative
        rows, self._rows, self._tensors, self._bytes = self._rows, [], {}, 0
        self.emit_rows(rows)
