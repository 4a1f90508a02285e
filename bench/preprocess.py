"""Benchmark: Kimi-K3 image preprocessing on CPU, side by side in one run.

    .venv/bin/python -m bench.preprocess [--repeats N] [--classes 12mp,48mp,rgba4mp,palette]

Per image class (12 MP JPEG; 48 MP JPEG that needs a resize; 4 MP RGBA PNG; palette PNG with
transparency) it prints the median of N runs of:
  decode        Image.open + load: the pixel decode alone (no numpy array)
  decode+array  decode, then np.asarray: what any numpy consumer of Pillow pays at least
  straight      the plain reference path (tests/k3_reference.py), pixel_values included
  project       vision.preprocess_image: padded uint8 model input, pixel_values NOT built
  project+pv    the same, then .pixel_values (float32 [N,3,14,14]) built
  count         vision.count_tokens (header only)
and the ratios straight/project+pv (target >= 4x on the 12 MP JPEG), project+pv/decode and
project/decode (target <= 1.5x decode on the 12 MP JPEG), decode/count (target >= 100x).
Every class first checks that the project output is bit-identical to the straightforward one.
With --fast it also times resize="fast" on the 48 MP class and reports its error against the
exact path for OpenCV INTER_AREA (what "fast" uses) and INTER_CUBIC.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from k3_reference import reference_preprocess  # noqa: E402

from vision import count_tokens, preprocess_image  # noqa: E402


def _photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Photo-like content: smooth gradients, edges and mild sensor noise (JPEG sizes realistic)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    r = 120 + 90 * np.sin(6 * x + 2 * y)
    g = 110 + 80 * np.cos(5 * y - 3 * x)
    b = 100 + 60 * np.sin(9 * x * y + 1) + 40 * ((x * 40).astype(np.int32) % 2)
    img = np.stack(np.broadcast_arrays(r, g, b), axis=-1)
    img += rng.normal(0, 6, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def make_class(name: str) -> bytes:
    if name == "12mp":
        return _encode(Image.fromarray(_photo(4000, 3000)), "JPEG", quality=90)
    if name == "48mp":
        return _encode(Image.fromarray(_photo(8000, 6000)), "JPEG", quality=90)
    if name == "rgba4mp":
        rgb = _photo(2000, 2000, 1)
        yy, xx = np.mgrid[0:2000, 0:2000]
        alpha = np.clip(255 - np.hypot(xx - 1000, yy - 1000) / 4, 0, 255).astype(np.uint8)
        return _encode(Image.fromarray(np.dstack([rgb, alpha])), "PNG", compress_level=1)
    if name == "palette":
        im = Image.fromarray(_photo(2000, 1500, 2)).quantize(64)
        return _encode(im, "PNG", transparency=bytes([0] + [255] * 63))
    raise SystemExit(f"unknown class {name!r}")


TITLES = {
    "12mp": "12 MP JPEG 4000x3000 (no resize)",
    "48mp": "48 MP JPEG 8000x6000 (resize)",
    "rgba4mp": "4 MP RGBA PNG 2000x2000",
    "palette": "palette PNG 2000x1500 + tRNS",
}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def decode_only(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def check_identical(data: bytes) -> None:
    ref = reference_preprocess(data)
    got = preprocess_image(data)
    assert np.array_equal(got.image, ref["image"]), "image differs"
    assert np.array_equal(got.pixel_values.view(np.uint32), ref["pixel_values"].view(np.uint32)), "pixels differ"


def bench_class(name: str, repeats: int) -> dict:
    data = make_class(name)
    check_identical(data)
    r = {"class": TITLES[name], "bytes": len(data)}
    r["decode"] = median_ms(lambda: decode_only(data), repeats)
    r["decode+array"] = median_ms(lambda: np.asarray(decode_only(data)), repeats)
    r["straight"] = median_ms(lambda: reference_preprocess(data), max(1, repeats // 2))
    r["project"] = median_ms(lambda: preprocess_image(data), repeats)
    r["project+pv"] = median_ms(lambda: preprocess_image(data).pixel_values, repeats)
    r["count"] = median_ms(lambda: count_tokens(data), repeats * 20)
    return r


def fast_report(repeats: int) -> None:
    import cv2

    from vision import preprocess as pp

    data = make_class("48mp")
    exact = preprocess_image(data)
    t_exact = median_ms(lambda: preprocess_image(data), repeats)
    t_fast = median_ms(lambda: preprocess_image(data, resize="fast"), repeats)
    print(f"\nresize='fast' on the 48 MP JPEG: exact {t_exact:.0f} ms, fast {t_fast:.0f} ms "
          f"({t_exact / t_fast:.2f}x), image only")
    h, w = exact.size[1], exact.size[0]
    decoded = np.asarray(decode_only(data))
    for label, interp in (("INTER_AREA (fast)", cv2.INTER_AREA), ("INTER_CUBIC", cv2.INTER_CUBIC)):
        out = cv2.resize(decoded, exact.size, interpolation=interp)
        diff = np.abs(out.astype(np.int16) - exact.image[:h, :w].astype(np.int16))
        print(f"  {label:18s} vs exact uint8: mean |d| {diff.mean():.3f}, max |d| {diff.max()}, "
              f"{(diff > 1).mean() * 100:.2f}% of values off by > 1")
    fast = preprocess_image(data, resize="fast")
    assert np.array_equal(fast.image, pp._to_padded_rgb(  # the fast path is INTER_AREA + the exact rest
        Image.fromarray(cv2.resize(decoded, exact.size, interpolation=cv2.INTER_AREA)), exact.padded_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--classes", default="12mp,48mp,rgba4mp,palette")
    parser.add_argument("--fast", action="store_true", help="also report resize='fast' speed and error")
    args = parser.parse_args()
    Image.init()
    preprocess_image(make_class("palette"))  # warm-up: plugin registration, cv2 import
    rows = [bench_class(name, args.repeats) for name in args.classes.split(",")]
    cols = ["decode", "decode+array", "straight", "project", "project+pv", "count"]
    print(f"median of {args.repeats} runs, ms (count: median of {args.repeats * 20}); outputs bit-identical")
    print("| image | " + " | ".join(cols) + " | straight / project+pv | project+pv / decode | project / decode "
          "| decode / count |")
    print("|---" * (len(cols) + 5) + "|")
    for r in rows:
        cells = [f"{r[c]:.1f}" if c == "count" else f"{r[c]:.0f}" for c in cols]
        print(f"| {r['class']} ({r['bytes'] / 1e6:.1f} MB) | " + " | ".join(cells)
              + f" | {r['straight'] / r['project+pv']:.1f}x | {r['project+pv'] / r['decode']:.2f}x"
              f" | {r['project'] / r['decode']:.2f}x | {r['decode'] / r['count']:.0f}x |")
    if args.fast:
        fast_report(max(1, args.repeats // 2))


if __name__ == "__main__":
    main()
