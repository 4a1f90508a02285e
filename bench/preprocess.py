"""Benchmark: Kimi-K3 image preprocessing on CPU, side by side in one run.

    .venv/bin/python -m bench.preprocess [--repeats N] [--classes 12mp,48mp,rgba4mp,palette]
                                         [--before GIT_REV] [--fast]

Per image class (12 MP JPEG; 48 MP JPEG that needs a resize; 4 MP RGBA PNG; palette PNG with
transparency) it prints the median of N runs of:
  decode        Image.open + load: the pixel decode alone (no numpy array)
  decode+array  decode, then np.asarray: what any numpy consumer of Pillow pays at least
  straight      the plain reference path (tests/k3_reference.py), pixel_values included
  sglang        SGLang's exact CPU path (python/sglang/srt/multimodal/cpu_image_processing.py,
                the fastest exact public one), restated here: the reference's uint8 steps, then
                its table patchify (uint8 re-layout, one table gather per channel, fresh output)
  project       vision.preprocess_image: padded uint8 model input, pixel_values NOT built
  project+pv    the same, then .pixel_values (float32 [N,3,14,14]) built in a fresh array
  worker+pv     what a CPU encoder worker runs: pixel_values built straight from the decoded
                pixels (vision.preprocess.preprocess_patches, no padded image) into a buffer
                reused from image to image (vision.buffers.BufferPool: no fresh pages)
  pv-write      allocating and filling a float32 array the size of pixel_values: a floor for
                building them (every byte of the output written once, nothing read)
  before, before+pv, before worker+pv  (with --before REV) project, project+pv and worker+pv for
                vision/preprocess.py as it was at git revision REV, loaded next to the current one
  count         vision.count_tokens (header only)
and the ratios straight/project+pv (target >= 4x on the 12 MP JPEG), project/decode and
project+pv/decode (target <= 1.5x decode on the 12 MP JPEG), worker+pv/decode (target <= 1.8x
on the 12 MP JPEG, one core), sglang/worker+pv (target >= 2.5x), decode/count (target >= 100x).
The timed calls take turns (one run of each, N times over), so load that drifts during the run
hits every column alike. Everything is single-threaded except what OpenCV threads internally;
--one-core pins the process to one CPU and OpenCV to one thread (what the worker+pv target is on).
The process keeps freed image buffers as an encoder worker does (service.engine.allocator).
Every class first checks that the project output is bit-identical to the straightforward one.
With --fast it also times resize="fast" on the 48 MP class and reports its error against the
exact path for OpenCV INTER_AREA (what "fast" uses) and INTER_CUBIC.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import cv2
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from k3_reference import reference_image, reference_preprocess  # noqa: E402

from bench.common import photo  # noqa: E402
from service.engine.allocator import KEEP_FREED_BYTES, keep_freed_memory  # noqa: E402
from vision import count_tokens, plan_image, preprocess_image  # noqa: E402
from vision import preprocess as vision_preprocess  # noqa: E402
from vision.buffers import BufferPool  # noqa: E402
from vision.options import ImageOptions  # noqa: E402
from vision.preprocess import NORMALISE_TABLE  # noqa: E402

FAST = ImageOptions(resize="fast")




def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def make_class(name: str) -> bytes:
    if name == "12mp":
        return _encode(Image.fromarray(photo(4000, 3000)), "JPEG", quality=90)
    if name == "48mp":
        return _encode(Image.fromarray(photo(8000, 6000)), "JPEG", quality=90)
    if name == "rgba4mp":
        rgb = photo(2000, 2000, 1)
        yy, xx = np.mgrid[0:2000, 0:2000]
        alpha = np.clip(255 - np.hypot(xx - 1000, yy - 1000) / 4, 0, 255).astype(np.uint8)
        return _encode(Image.fromarray(np.dstack([rgb, alpha])), "PNG", compress_level=1)
    if name == "palette":
        im = Image.fromarray(photo(2000, 1500, 2)).quantize(64)
        return _encode(im, "PNG", transparency=bytes([0] + [255] * 63))
    raise SystemExit(f"unknown class {name!r}")


TITLES = {
    "12mp": "12 MP JPEG 4000x3000 (no resize)",
    "48mp": "48 MP JPEG 8000x6000 (resize)",
    "rgba4mp": "4 MP RGBA PNG 2000x2000",
    "palette": "palette PNG 2000x1500 + tRNS",
}


def median_ms(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    return interleaved_ms({"fn": fn}, repeats)["fn"]


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and process CPU time of each function in ms, the functions taking turns
    `repeats` times. CPU time (all threads, user + system) is what a loaded machine disturbs least."""
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return {name: {k: 1000 * statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def decode_only(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def preprocess_at(rev: str) -> ModuleType:
    """vision/preprocess.py as it was at git revision `rev`, as a module (it imports the rest of
    the current `vision` package)."""
    source = subprocess.run(["git", "show", f"{rev}:vision/preprocess.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = "vision._preprocess_before"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "vision"
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(source, f"{rev}:vision/preprocess.py", "exec"), module.__dict__)
    return module


def sglang_table_path(data: bytes) -> np.ndarray:
    """SGLang's exact CPU preprocessing, restated (not its code): the processor's own uint8 steps
    (here the reference's: decode, resize, fill, pad), then the uint8 image re-laid into patch
    order and one 256-entry table gather per channel into a new float32 array."""
    image = reference_image(data)[2]
    h, w, c = image.shape
    patches = np.ascontiguousarray(image.reshape(h // 14, 14, w // 14, 14, c).transpose(0, 2, 4, 1, 3))
    out = np.empty(patches.shape, dtype=np.float32)
    for channel in range(c):
        out[:, :, channel] = NORMALISE_TABLE[patches[:, :, channel]]
    return out.reshape(-1, c, 14, 14)


class WorkerPath:
    """A CPU encoder worker's host path: pixel_values built in a buffer it reuses, straight from
    the decoded pixels (`preprocess_patches`). `module`: vision.preprocess, or an earlier revision
    of it; one without `preprocess_patches` runs what workers ran then: the padded image in a
    reused buffer, then the patches from it."""

    def __init__(self, module: ModuleType = vision_preprocess) -> None:
        self.module = module
        self.images, self.patches = BufferPool(np.uint8), BufferPool(np.float32)

    def __call__(self, data: bytes) -> np.ndarray:
        plan = plan_image(data)
        with self.patches.take(plan.pixel_values_size) as values:
            if hasattr(self.module, "preprocess_patches"):
                return self.module.preprocess_patches(data, out=values)[1]
            with self.images.take(plan.image_bytes) as image:
                return self.module.patchify_normalise(self.module.preprocess_image(data, out=image).image, values)


def check_identical(data: bytes, before: ModuleType | None, worker: WorkerPath) -> None:
    ref = reference_preprocess(data)
    ref_pv = ref["pixel_values"].view(np.uint32)
    for fn in (preprocess_image, before.preprocess_image) if before else (preprocess_image,):
        got = fn(data)
        assert np.array_equal(got.image, ref["image"]), "image differs"
        assert np.array_equal(got.pixel_values.view(np.uint32), ref_pv), "pixels differ"
    assert np.array_equal(worker(data).view(np.uint32), ref_pv), "worker pixels differ"
    if before:
        assert np.array_equal(WorkerPath(before)(data).view(np.uint32), ref_pv), "before worker pixels differ"
    assert np.array_equal(sglang_table_path(data).view(np.uint32), ref_pv), "sglang pixels differ"


def bench_class(name: str, repeats: int, before: ModuleType | None) -> dict:
    data = make_class(name)
    worker = WorkerPath()
    check_identical(data, before, worker)
    pv_shape = preprocess_image(data).pixel_values.shape
    fns = {
        "decode": lambda: decode_only(data),
        "decode+array": lambda: np.asarray(decode_only(data)),
        "sglang": lambda: sglang_table_path(data),
        "project": lambda: preprocess_image(data),
        "project+pv": lambda: preprocess_image(data).pixel_values,
        "worker+pv": lambda: worker(data),
        "pv-write": lambda: np.empty(pv_shape, np.float32).fill(1.0),
    }
    if before:
        before_worker = WorkerPath(before)
        fns["before"] = lambda: before.preprocess_image(data)
        fns["before+pv"] = lambda: before.preprocess_image(data).pixel_values
        fns["before worker+pv"] = lambda: before_worker(data)
    r = {"class": TITLES[name], "bytes": len(data), **interleaved_ms(fns, repeats)}
    r["straight"] = median_ms(lambda: reference_preprocess(data), max(1, repeats // 2))
    r["count"] = median_ms(lambda: count_tokens(data), repeats * 20)
    return r


def fast_report(repeats: int) -> None:
    from vision import preprocess as pp

    data = make_class("48mp")
    exact = preprocess_image(data)
    t = interleaved_ms({"exact": lambda: preprocess_image(data), "fast": lambda: preprocess_image(data, FAST)},
                       repeats)
    t_exact, t_fast = t["exact"]["wall"], t["fast"]["wall"]
    print(f"\nresize='fast' on the 48 MP JPEG (wall): exact {t_exact:.0f} ms, fast {t_fast:.0f} ms "
          f"({t_exact / t_fast:.2f}x), image only")
    h, w = exact.size[1], exact.size[0]
    decoded = np.asarray(decode_only(data))
    for label, interp in (("INTER_AREA (fast)", cv2.INTER_AREA), ("INTER_CUBIC", cv2.INTER_CUBIC)):
        out = cv2.resize(decoded, exact.size, interpolation=interp)
        diff = np.abs(out.astype(np.int16) - exact.image[:h, :w].astype(np.int16))
        print(f"  {label:18s} vs exact uint8: mean |d| {diff.mean():.3f}, max |d| {diff.max()}, "
              f"{(diff > 1).mean() * 100:.2f}% of values off by > 1")
    fast = preprocess_image(data, FAST)
    assert np.array_equal(fast.image, pp._to_padded_rgb(  # the fast path is INTER_AREA + the exact rest
        Image.fromarray(cv2.resize(decoded, exact.size, interpolation=cv2.INTER_AREA)), exact.padded_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--classes", default="12mp,48mp,rgba4mp,palette")
    parser.add_argument("--fast", action="store_true", help="also report resize='fast' speed and error")
    parser.add_argument("--before", metavar="GIT_REV", help="also time vision/preprocess.py as of this revision")
    parser.add_argument("--one-core", action="store_true", help="run on one CPU, OpenCV on one thread")
    args = parser.parse_args()
    # An encoder worker's allocator setting (it imports torch, then keeps freed image buffers), so
    # every column decodes as a worker does: no page faults for Pillow's blocks.
    keep_freed_memory(KEEP_FREED_BYTES)
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        cv2.setNumThreads(1)
    Image.init()
    before = preprocess_at(args.before) if args.before else None
    preprocess_image(make_class("palette"))  # warm-up: plugin registration, cv2 import
    rows = [bench_class(name, args.repeats, before) for name in args.classes.split(",")]
    cols = ["decode", "decode+array", "straight", "sglang", "project", "project+pv", "worker+pv", "pv-write"]
    cols += ["before", "before+pv", "before worker+pv"] if before else []
    cols += ["count"]
    ratios = {  # label -> (numerator, denominator)
        "straight / project+pv": ("straight", "project+pv"),
        "project / decode": ("project", "decode"),
        "project+pv / decode": ("project+pv", "decode"),
        "worker+pv / decode": ("worker+pv", "decode"),
        "sglang / worker+pv": ("sglang", "worker+pv"),
    }
    if before:
        ratios["before / decode"] = ("before", "decode")
        ratios["before+pv / decode"] = ("before+pv", "decode")
        ratios["before worker+pv / decode"] = ("before worker+pv", "decode")
    ratios["decode / count"] = ("decode", "count")
    for clock, title in (("wall", "wall-clock time"), ("cpu", "process CPU time (all threads, user + system)")):
        print(f"\n{title}: median of {args.repeats} interleaved runs, ms (straight: median of "
              f"{max(1, args.repeats // 2)}; count: median of {args.repeats * 20}); outputs bit-identical"
              + (f"; before = vision/preprocess.py at {args.before}" if before else ""))
        print("| image | " + " | ".join(cols + list(ratios)) + " |")
        print("|---" * (len(cols) + len(ratios) + 1) + "|")
        for r in rows:
            cells = [f"{r[c][clock]:.1f}" if c == "count" else f"{r[c][clock]:.0f}" for c in cols]
            for num, den in ratios.values():
                value = r[num][clock] / r[den][clock]
                cells.append(f"{value:.0f}x" if den == "count" else f"{value:.2f}x")
            print(f"| {r['class']} ({r['bytes'] / 1e6:.1f} MB) | " + " | ".join(cells) + " |")
    if args.fast:
        fast_report(max(1, args.repeats // 2))


if __name__ == "__main__":
    main()
