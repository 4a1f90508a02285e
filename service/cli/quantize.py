"""`kimi-vision quantize IN_DIR OUT_DIR [--config JSON]`: a bf16 checkpoint -> MXFP4
(`service.checkpoints.quantize`: with the default K3 config, the routed experts, as the release)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
    quant = None
    if args.config:
        try:
            quant = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            return _fail(f"cannot read --config {args.config}: {e}")

    from service.checkpoints.quantize import QuantizeError, quantize_checkpoint
    from vision.checkpoint import DEFAULT_MAX_SHARD_BYTES

    try:
        packed = quantize_checkpoint(src, out, quant, args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    except QuantizeError as e:
        return _fail(str(e))
    print(f"quantized {len(packed)} linear layers to MXFP4; wrote {out}")
    return 0
