"""What identifies a model and one image's embedding: the checkpoint fingerprint and the content hash.

`checkpoint_fingerprint` is THE model identity: the engine computes it once when it loads, the
gRPC server reports it (`GetModelInfo`), and batch jobs store it in their fingerprint, so a job may
be resumed in-process or against a server as long as both run the same weights. `content_hash`
keys the embedding cache and names what `Embed` reports.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from vision.options import ImageOptions

# Bytes hashed from each weight file's start and end: enough to tell two checkpoints of the same
# shapes apart (e.g. two random seeds) without reading terabytes.
_SAMPLE_BYTES = 1 << 20


def checkpoint_fingerprint(directory: str | Path) -> str:
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


def content_hash(data: bytes, options: ImageOptions, fingerprint: str) -> str:
    """The key of one image's embedding: sha256 over the checkpoint fingerprint, the preprocessing
    options' canonical string (which carries the preprocessing version) and the bytes."""
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(options.key().encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()
