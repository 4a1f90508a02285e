"""A bf16 checkpoint -> MXFP4 (`mxfp4-pack-quantized`).

Every linear layer the quantization config targets and does not ignore is replaced by
`X.weight_packed` + `X.weight_scale`; with the default, the K3 config, that is the routed experts'
w1/w2/w3, exactly as the release stores them (`make.packed_linears`). All other tensors are
copied unchanged. Which tensors belong to linear layers is read off the models config.json
describes (the KimiLinear trunk, the MoonViT tower and projector), built on the meta device.
config.json gains a top-level `quantization_config` (where the published checkpoint has it), the
safetensors index is rewritten, and every other file (tokenizer, preprocessor config, ...) is copied.

Memory: write_checkpoint holds the whole output until it writes, so this is meant for
checkpoints that fit in RAM (test and small models); the published K3 ships already packed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from service.checkpoints.make import packed_linears
from textcore.mxfp4 import K3_QUANTIZATION_CONFIG, PACKED_SUFFIX, MXFP4Error, quantize_tensors
from vision.checkpoint import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, Checkpoint, CheckpointError, write_checkpoint


class QuantizeError(Exception):
    """The conversion cannot be done; the message says why."""


class _LazyTensors(Mapping[str, torch.Tensor]):
    """A read-once mapping over a checkpoint's tensors (each is loaded when asked for)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self._ckpt = ckpt
        self._names = ckpt.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._ckpt.tensor(name)


def quantize_checkpoint(src: Path, out: Path, quant: dict[str, Any] | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write `out` from `src` (None: the K3 config); returns the names of the packed layers."""
    quant = K3_QUANTIZATION_CONFIG if quant is None else quant
    try:
        ckpt = Checkpoint(src)
    except CheckpointError as e:
        raise QuantizeError(str(e)) from None
    config = ckpt.config
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    if "quantization_config" in config or (text_config and "quantization_config" in text_config):
        raise QuantizeError(f"{src} is already quantized (config.json has a quantization_config)")
    already = [n for n in ckpt.names() if n.endswith(f".{PACKED_SUFFIX}")]
    if already:
        raise QuantizeError(f"{src} already holds packed tensors, e.g. {already[0]}")
    try:
        linear = packed_linears(config, quant)
    except (ValueError, KeyError, TypeError) as e:
        raise QuantizeError(f"{src / 'config.json'}: {e}") from None
    try:
        tensors = quantize_tensors(_LazyTensors(ckpt), quant, linear_modules=linear)
    except (MXFP4Error, CheckpointError) as e:
        raise QuantizeError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged shard: safetensors raises its own error types
        raise QuantizeError(f"cannot read the tensors of {src}: {e}") from None
    packed = sorted(n.removesuffix(f".{PACKED_SUFFIX}") for n in tensors if n.endswith(f".{PACKED_SUFFIX}"))
    if not packed:
        raise QuantizeError(f"the quantization_config targets no linear layer of {src}; nothing to convert")
    try:
        write_checkpoint(out, tensors, {**config, "quantization_config": quant}, max_shard_bytes=max_shard_bytes)
        skip = {"config.json", INDEX_FILE}
        for item in sorted(ckpt.path.iterdir()):
            if item.name in skip or item.name.endswith(".safetensors") or item.name.startswith("."):
                continue
            _copy_content(item, out / item.name)
    except OSError as e:
        raise QuantizeError(f"cannot write {out}: {e}") from None
    finally:
        ckpt.close()
    return packed


def _copy_content(src: Path, dst: Path) -> None:
    """Copy a file, or a directory recursively, by content only: every copy gets ordinary
    permissions (mkdir and open under the umask), as the files written here do. shutil.copytree
    would copy each directory's mode, whatever its copy_function."""
    if src.is_dir():
        dst.mkdir()
        for child in sorted(src.iterdir()):
            _copy_content(child, dst / child.name)
    else:
        shutil.copyfile(src, dst)
