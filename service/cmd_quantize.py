"""`kimi-vision quantize IN_DIR OUT_DIR`: a bf16 checkpoint -> MXFP4 (`mxfp4-pack-quantized`).

Every linear layer the quantization config targets and does not ignore (by default the K3
config) is replaced by `X.weight_packed` + `X.weight_scale`; all other tensors are copied
unchanged. Which tensors belong to linear layers is read off the models config.json describes
(the KimiLinear trunk, the MoonViT tower and projector), built on the meta device. config.json
gains a top-level `quantization_config` (where the published checkpoint has it), the safetensors
index is rewritten, and every other file (tokenizer, preprocessor config, ...) is copied.

Memory: write_checkpoint holds the whole output until it writes, so this is meant for
checkpoints that fit in RAM (test and small models); the published K3 ships already packed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HELP = "convert a bf16 checkpoint to MXFP4 (compressed-tensors mxfp4-pack-quantized) per its ignore list"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("in_dir", metavar="IN_DIR", help="bf16 checkpoint directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--config",
        metavar="JSON",
        help="quantization_config to apply (a JSON file in the compressed-tensors schema; default: the K3 one)",
    )
    parser.add_argument(
        "--max-shard-bytes", type=int, default=None, help="largest output shard in bytes (default: 2 GiB)"
    )


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.in_dir), Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return _fail(f"{out} exists and is not an empty directory")
    if out.resolve() == src.resolve():
        return _fail("OUT_DIR must differ from IN_DIR")
    if args.max_shard_bytes is not None and args.max_shard_bytes <= 0:
        return _fail(f"--max-shard-bytes must be positive, got {args.max_shard_bytes}")

    from service.make_checkpoint import linear_module_names
    from textcore.mxfp4 import K3_QUANTIZATION_CONFIG, MXFP4Error, quantize_tensors
    from vision.checkpoint import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, Checkpoint, CheckpointError, write_checkpoint

    try:
        ckpt = Checkpoint(src)
    except CheckpointError as e:
        return _fail(str(e))
    config = ckpt.config
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    if "quantization_config" in config or (text_config and "quantization_config" in text_config):
        return _fail(f"{src} is already quantized (config.json has a quantization_config)")
    already = [n for n in ckpt.names() if n.endswith(".weight_packed")]
    if already:
        return _fail(f"{src} already holds packed tensors, e.g. {already[0]}")
    if args.config:
        try:
            quant = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            return _fail(f"cannot read --config {args.config}: {e}")
    else:
        quant = K3_QUANTIZATION_CONFIG

    try:
        linear = linear_module_names(config)
    except (ValueError, KeyError, TypeError) as e:
        return _fail(f"{src / 'config.json'}: {e}")
    try:
        tensors = quantize_tensors(_LazyTensors(ckpt), quant, linear_modules=linear)
    except (MXFP4Error, CheckpointError) as e:
        return _fail(str(e))
    except Exception as e:  # a damaged shard: safetensors raises its own error types
        return _fail(f"cannot read the tensors of {src}: {e}")
    packed = sorted(n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed"))
    if not packed:
        return _fail(f"the quantization_config targets no linear layer of {src}; nothing to convert")

    new_config = {**config, "quantization_config": quant}
    try:
        write_checkpoint(out, tensors, new_config, max_shard_bytes=args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        skip = {"config.json", INDEX_FILE}
        for item in sorted(ckpt.path.iterdir()):
            if item.name in skip or item.name.endswith(".safetensors") or item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, out / item.name)
            else:
                shutil.copy2(item, out / item.name)
    except OSError as e:
        return _fail(f"cannot write {out}: {e}")
    ckpt.close()
    print(f"quantized {len(packed)} linear layers to MXFP4; wrote {out}")
    return 0


class _LazyTensors:
    """A read-once mapping over a checkpoint's tensors (each is loaded when asked for)."""

    def __init__(self, ckpt):
        self._ckpt = ckpt
        self._names = ckpt.names()

    def keys(self) -> list[str]:
        return list(self._names)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str):
        return self._ckpt.tensor(name)
