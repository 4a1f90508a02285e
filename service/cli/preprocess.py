"""`kimi-vision preprocess [--json] FILE...`: what Kimi-K3's processor makes of each image.

Every file is processed even when others fail; a failing file gets an error line (a JSON object
with "error" under --json) and the command exits with status 2 at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from service.cli.common import add_image_limit_arguments, image_limits, read_image_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="image files")
    parser.add_argument("--json", action="store_true", help="one JSON object per line per file")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="strict cap on tokens per image (default: the reference's own budget)")
    parser.add_argument("--exif-transpose", action="store_true",
                        help="apply the EXIF orientation first (the reference does not)")
    parser.add_argument("--resize", choices=("exact", "fast"), default="exact",
                        help="exact: Pillow BICUBIC as the reference; fast: OpenCV, not bit-exact")
    add_image_limit_arguments(parser)


def _row(path: str, out, seconds: float) -> dict:
    (ow, oh), (w, h), (pw, ph) = out.orig_size, out.size, out.padded_size
    return {
        "file": path,
        "orig_width": ow,
        "orig_height": oh,
        "width": w,
        "height": h,
        "padded_width": pw,
        "padded_height": ph,
        "grid_thw": list(out.grid_thw),
        "tokens": out.num_tokens,
        "prompt": out.prompt,
        "format": out.source_format,
        "mode": out.source_mode,
        "ms": round(seconds * 1000, 1),
    }


def _print_table(rows: list[dict]) -> None:
    header = ("file", "format", "mode", "original", "resized", "padded", "grid_thw", "tokens", "ms")
    lines = [header]
    for r in rows:
        if "error" in r:
            continue
        lines.append((
            r["file"], r["format"], r["mode"], f"{r['orig_width']}x{r['orig_height']}", f"{r['width']}x{r['height']}",
            f"{r['padded_width']}x{r['padded_height']}", "x".join(map(str, r["grid_thw"])), str(r["tokens"]),
            f"{r['ms']:.1f}",
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    numeric = {"tokens", "ms"}
    for line in lines:
        cells = [
            str(c).rjust(wd) if header[i] in numeric else str(c).ljust(wd)
            for i, (c, wd) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    ok = [r for r in rows if "error" not in r]
    print(f"{len(ok)} image(s), {sum(r['tokens'] for r in ok)} tokens" +
          (f"; {len(rows) - len(ok)} failed" if len(ok) != len(rows) else ""))


def run(args: argparse.Namespace) -> int:
    from vision import ImageError, ImageOptions, preprocess_image

    try:
        options = ImageOptions(max_tokens=args.max_tokens, exif_transpose=args.exif_transpose, resize=args.resize)
    except ImageError as e:
        print(f"kimi-vision preprocess: {e}", file=sys.stderr)
        return 2
    from PIL import Image

    Image.init()  # register Pillow's plugins now, so the first file's time is its own
    limits = image_limits(args)
    rows: list[dict] = []
    for path in args.files:
        try:
            data = read_image_file(path, limits)
            start = time.perf_counter()
            out = preprocess_image(data, options, limits)
            row = _row(path, out, time.perf_counter() - start)
        except (ImageError, OSError) as e:
            message = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            row = {"file": path, "error": message}
            if not args.json:
                print(f"kimi-vision preprocess: {path}: {message}", file=sys.stderr)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        _print_table(rows)
    return 2 if any("error" in r for r in rows) else 0
