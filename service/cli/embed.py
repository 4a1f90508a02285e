"""`kimi-vision embed [--checkpoint DIR] [--workers N | --devices SPEC] [--format F] --out OUT FILE...`

Encodes each image through the engine (exact preprocessing, the tower and projector; the trunk
is never loaded) and writes one tensor per input, `[num_tokens, text hidden size]`, keyed by the
file name as given (a repeated name gets `#2`, `#3`, ...). The safetensors metadata entry
`kimi_vision` holds, per key, the grid, token count and prompt text. A file that fails is reported
and skipped; the exit status is then 2.

`--format vllm-ec` writes instead, for encoder disaggregation, `OUT/<mm_hash>/encoder_cache.safetensors`
with one tensor `ec_cache` per image (in `--dtype`, default bfloat16: what vLLM holds), the layout
vLLM's shared-storage encoder-cache connector reads, named by the `mm_hash` vLLM computes for the
image (`--vllm-model-id`, `--mm-hasher-algorithm`: what the vLLM instance runs with).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from service.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="image files")
    parser.add_argument("--out", required=True, metavar="OUT",
                        help="output .safetensors file, or directory with --format vllm-ec")
    parser.add_argument("--format", choices=("safetensors", "vllm-ec"), default="safetensors",
                        help="safetensors (default): one file, a tensor per input; "
                        "vllm-ec: OUT/<hash>/encoder_cache.safetensors per image")
    common.add_model_arguments(parser, devices=False)
    parser.add_argument("--workers", type=common.positive_int, metavar="N", help="number of CPU encoder workers")
    parser.add_argument("--devices", metavar="SPEC", help="auto (default), cpu:N or cuda:0,1,...")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="tensor dtype (default: float32; bfloat16 with --format vllm-ec)")
    common.add_image_limit_arguments(parser)
    common.add_vllm_arguments(parser)


def _unique_key(name: str, used: set[str]) -> str:
    key, n = name, 1
    while key in used:
        n += 1
        key = f"{name}#{n}"
    used.add(key)
    return key


async def _embed_files(engine, names: list[str]) -> list[tuple[str, object, str]]:
    """(name, MediaEmbedding or the failure message, vLLM's key) per file, in order; a few in flight."""
    import asyncio

    from service.engine import MediaInput
    from service.engine.store import item_key
    from service.errors import classify

    slots = asyncio.Semaphore(2 * len(engine.devices))
    limits = engine.config.limits

    async def one(name: str) -> tuple[str, object, str]:
        async with slots:
            try:
                try:
                    image = MediaInput(common.read_image_file(name, limits))
                except OSError as e:
                    return name, e.strerror or str(e), ""
                (emb,) = await engine.embed([image])
            except Exception as exc:  # noqa: BLE001 - a classified failure is that file's; a bug propagates
                failure = classify(exc)
                if failure is None:
                    raise
                return name, failure.message, ""
            return name, emb, item_key(image.data, None, engine.model_id, engine.config.hash_algorithm)

    return list(await asyncio.gather(*(one(name) for name in names)))


def run(args: argparse.Namespace) -> int:
    if args.workers is not None and args.devices not in (None, "auto"):
        print("error: give either --workers (CPU) or --devices, not both", file=sys.stderr)
        return 2

    import asyncio

    import torch
    from safetensors.torch import save_file

    from service.engine import Engine, EngineConfig
    from service.engine.store import write_ec
    from service.errors import ServiceError
    from service.files import atomic_path
    from vision.checkpoint import CheckpointError

    devices = f"cpu:{args.workers}" if args.workers is not None else (args.devices or "auto")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.format == "vllm-ec" else "float32"))
    start = time.perf_counter()
    try:
        engine = Engine.load(EngineConfig(checkpoint=common.checkpoint_dir(args.checkpoint), devices=devices,
                                          components="vision", cache_bytes=0, limits=common.image_limits(args),
                                          model_id=args.vllm_model_id, hash_algorithm=args.mm_hasher_algorithm))
    except (CheckpointError, ServiceError, ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(_embed_files(engine, args.files))
    finally:
        engine.close()
    status = 0
    tensors, meta, used, hashes = {}, {}, set(), {}
    for name, result, vllm_key in results:
        if isinstance(result, str):
            print(f"error: {name}: {result}", file=sys.stderr)
            status = 2
            continue
        key = _unique_key(name, used)
        # a copy: one image named twice shares one encode's rows (single flight), and safetensors refuses
        # tensors that share memory
        tensors[key] = result.rows.to(dtype, copy=True).contiguous()
        hashes[key] = vllm_key
        meta[key] = {"grid_thw": list(result.grid_thw), "tokens": result.num_tokens, "prompt": result.prompt}
        print(f"{key}: {result.num_tokens} tokens -> {list(result.rows.shape)} "
              f"{str(result.rows.dtype).removeprefix('torch.')}")
    if not tensors:
        print("error: no image could be encoded; nothing written", file=sys.stderr)
        return 2
    if args.format == "vllm-ec":
        for key, rows in tensors.items():
            try:  # an existing entry is kept, never replaced (service.epd.vllm_storage)
                print(f"{key}: {write_ec(args.out, hashes[key], rows, hashes[key], key, engine.fingerprint)}")
            except ServiceError as e:
                print(f"error: {e}", file=sys.stderr)
                status = 2
    else:
        with atomic_path(args.out) as tmp:  # ordinary permissions (save_file's own are 0600), and atomic
            save_file(tensors, str(tmp), metadata={"kimi_vision": json.dumps(meta, sort_keys=True)})
    print(f"wrote {len(tensors)} embeddings to {args.out} in {time.perf_counter() - start:.2f} s")
    return status
