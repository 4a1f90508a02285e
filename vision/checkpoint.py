"""Checkpoint directories in the published Kimi-K3 layout.

A checkpoint is a directory (possibly a Hugging Face snapshot made of symlinks) holding
`config.json`, `preprocessor_config.json`, tokenizer files, and either one
`model.safetensors` or `model.safetensors.index.json` plus shards. Tensors are read lazily
through memory-mapped shards, so loading one sub-model (the vision tower) never touches the
others (the trunk's ~1.5 TB): a shard is opened only when one of its tensors is asked for, and
checked to exist only when a sub-model's tensors are (a vision-only deployment may leave the
trunk's shards out).

This module knows nothing about any model: the tower and the trunk each ask for their prefix.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_MAX_LISTED = 12  # names shown per category in an error; the count is always exact


class CheckpointError(Exception):
    """A checkpoint directory that cannot be used, with what exactly is wrong."""


def _listing(label: str, names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"{len(names)} {label}: {shown}{more}"


class Checkpoint:
    """Read-only view of a checkpoint directory."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        self.config = self.read_json(CONFIG_FILE)
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            weight_map = self.read_json(INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has no weight_map")
            self._file_of: dict[str, str] = dict(weight_map)
        elif (self.path / SINGLE_FILE).exists():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                self._file_of = {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._handles: dict[str, object] = {}

    def read_json(self, name: str) -> dict:
        p = self.path / name
        try:
            return json.loads(p.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} has no {name}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p} is not valid JSON: {e}") from None

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return self._handles[file]

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self._file_of if n.startswith(prefix))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return self._handle(self._file_of[name]).get_tensor(name)

    def check(self, expected: Mapping[str, tuple[int, ...]], prefix: str) -> None:
        """Raise one CheckpointError naming every missing, unexpected and mis-shaped tensor (and,
        first, every shard file that holds `prefix`* tensors but is not there)."""
        present = set(self.names(prefix))
        absent = sorted({self._file_of[n] for n in present if not (self.path / self._file_of[n]).exists()})
        if absent:
            raise CheckpointError(f"{self.path}: {_listing(f'shard files of {prefix!r}* missing', absent)}")
        want = {prefix + k: tuple(v) for k, v in expected.items()}
        missing = sorted(set(want) - present)
        unexpected = sorted(present - set(want))
        misshaped = sorted(
            f"{n} {list(self.shape(n))} (expected {list(want[n])})"
            for n in set(want) & present
            if self.shape(n) != want[n]
        )
        problems = [
            _listing(label, names)
            for label, names in (
                ("missing tensors", missing),
                ("unexpected tensors", unexpected),
                ("tensors with the wrong shape", misshaped),
            )
            if names
        ]
        if problems:
            raise CheckpointError(f"checkpoint {self.path} does not match {prefix!r}*: " + "; ".join(problems))

    def load_into(self, module: torch.nn.Module, prefix: str) -> None:
        """Strictly load `prefix`* into `module` (which may live on the meta device).

        Floating tensors are cast to the dtype the module declares; integer tensors (packed
        MXFP4 codes and scales) are taken as stored.
        """
        own = module.state_dict(keep_vars=True)
        self.check({k: tuple(v.shape) for k, v in own.items()}, prefix)
        state = {}
        for key, current in own.items():
            t = self.tensor(prefix + key)
            if t.is_floating_point() and current.is_floating_point():
                t = t.to(current.dtype)
            state[key] = t
        module.load_state_dict(state, strict=True, assign=True)

    def close(self) -> None:
        self._handles.clear()


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    config: Mapping,
    *,
    json_files: Mapping[str, Mapping] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `tensors` as index + shards (sorted names, greedy shards), `config.json` and any
    extra JSON files. Deterministic: the same inputs give byte-identical files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, out / fname)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / CONFIG_FILE, config)
    for name, content in (json_files or {}).items():
        _write_json(out / name, content)
    return out


def _save_shard(shard: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, leaving the file with the permissions `open()` gives (0666 less the umask), as
    every other file of the checkpoint has: safetensors writes a 0600 file of its own whatever the
    umask, and a checkpoint is often read by another user (a container's, a server's)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    save_file(shard, str(path), metadata={"format": "pt"})
    os.chmod(path, mode)


def _write_json(path: Path, content: Mapping | Iterable) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
