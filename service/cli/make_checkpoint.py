"""`kimi-vision make-checkpoint [--preset tiny|k3] [--seed N] DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory (must not exist or be empty)")
    parser.add_argument("--preset", default="tiny", help="model sizes: tiny (default) or k3")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--bf16", action="store_true",
                        help="keep every trunk weight bf16 (no MXFP4), e.g. as input for `kimi-vision quantize`")


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out} exists and is not an empty directory", file=sys.stderr)
        return 2
    from vision.config import PRESETS

    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 2
    from service.checkpoints.make import make_checkpoint

    path = make_checkpoint(out, preset=args.preset, seed=args.seed, mxfp4=not args.bf16)
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {path}")
    return 0
