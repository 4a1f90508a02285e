"""`kimi-vision preview FILE -o OUT.png [--grid]`: the exact padded image the model sees.

Without --grid the PNG holds exactly `Preprocessed.image` (lossless, byte for byte the same
pixels). --grid draws the 28-px token grid over it for people to look at; that file is no longer
the model input.
"""

from __future__ import annotations

import argparse
import sys

from service.cli.common import add_image_limit_arguments, image_limits, read_image_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="image file")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.png", help="PNG file to write")
    parser.add_argument("--grid", action="store_true", help="overlay the 28-px token grid (for viewing only)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N", help="strict cap on tokens")
    parser.add_argument("--exif-transpose", action="store_true", help="apply the EXIF orientation first")
    parser.add_argument("--resize", choices=("exact", "fast"), default="exact", help="resize method")
    add_image_limit_arguments(parser)


def grid_overlay(image, cell: int = 28):
    """A copy of `image` (uint8 H x W x 3) with token-cell borders drawn: the first pixel row
    and column of each cell, inverted, so the lines show on any content."""
    import numpy as np

    out = np.array(image, copy=True)
    border = np.zeros(out.shape[:2], dtype=bool)
    border[::cell, :] = True
    border[:, ::cell] = True
    out[border] = 255 - out[border]  # once per pixel, crossings included
    return out


def run(args: argparse.Namespace) -> int:
    from PIL import Image

    from vision import ImageError, ImageOptions, preprocess_image

    if not args.output.lower().endswith(".png"):
        print(f"kimi-vision preview: {args.output}: the output must be a .png file (lossless)", file=sys.stderr)
        return 2
    try:
        limits = image_limits(args)
        out = preprocess_image(read_image_file(args.file, limits),
                               ImageOptions(max_tokens=args.max_tokens, exif_transpose=args.exif_transpose,
                                            resize=args.resize), limits)
    except ImageError as e:
        print(f"kimi-vision preview: {args.file}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kimi-vision preview: {args.file}: {e.strerror or e}", file=sys.stderr)
        return 2
    pixels = grid_overlay(out.image) if args.grid else out.image
    try:
        Image.fromarray(pixels).save(args.output, "PNG")
    except OSError as e:
        print(f"kimi-vision preview: {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    w, h = out.padded_size
    print(f"{args.output}: {w}x{h} padded model input, {out.num_tokens} tokens"
          + (" (token grid drawn; not the model input)" if args.grid else ""))
    return 0
