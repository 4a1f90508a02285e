"""`kimi-vision embed [--checkpoint DIR] [--workers N | --devices SPEC] [--format F] --out OUT FILE...`

Preprocesses each image exactly as the reference does, encodes it through the encoder pool and
writes one tensor per input, `[num_tokens, text hidden size]`, keyed by the file name as given
(a repeated name gets `#2`, `#3`, ...). The safetensors metadata entry `kimi_vision` holds, per
key, the grid, token count and prompt text. A file that fails is reported and skipped; the
exit status is then 2.

`--format vllm-ec` writes instead, for encoder disaggregation, `OUT/<hash>/encoder_cache.safetensors`
with one tensor `ec_cache` per image (the layout vLLM's shared-storage encoder-cache connector
reads); `<hash>` is the service's content hash (bytes + preprocessing options + checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "encode images into Kimi-K3 image embeddings (safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="image files")
    parser.add_argument("--out", required=True, metavar="OUT",
                        help="output .safetensors file, or directory with --format vllm-ec")
    parser.add_argument("--format", choices=("safetensors", "vllm-ec"), default="safetensors",
                        help="safetensors (default): one file, a tensor per input; "
                        "vllm-ec: OUT/<hash>/encoder_cache.safetensors per image")
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--workers", type=int, metavar="N", help="number of CPU encoder workers")
    parser.add_argument("--devices", metavar="SPEC", help="auto (default), cpu:N or cuda:0,1,...")


def _unique_key(name: str, used: set[str]) -> str:
    key, n = name, 1
    while key in used:
        n += 1
        key = f"{name}#{n}"
    used.add(key)
    return key


def run(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        print(f"error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    if args.workers is not None and args.devices not in (None, "auto"):
        print("error: give either --workers (CPU) or --devices, not both", file=sys.stderr)
        return 2

    import vision
    from vision.checkpoint import CheckpointError

    status = 0
    prepared = []
    for name in args.files:
        try:
            with open(name, "rb") as f:
                data = f.read()
            prepared.append((name, data, vision.preprocess_image(data)))
        except (OSError, vision.ImageError) as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            status = 2
    if not prepared:
        print("error: no image could be read; nothing written", file=sys.stderr)
        return 2

    from safetensors.torch import save_file

    from service.default_checkpoint import default_checkpoint_dir
    from vision.pool import EncoderPool, PoolError

    checkpoint = args.checkpoint or default_checkpoint_dir()
    start = time.perf_counter()
    try:
        with EncoderPool(checkpoint, devices=args.devices, workers=args.workers) as pool:
            futures = [(name, data, item, pool.submit(item)) for name, data, item in prepared]
            tensors, meta, used, hashes = {}, {}, set(), {}
            for name, data, item, future in futures:
                try:
                    emb = future.result()
                except PoolError as e:
                    print(f"error: {name}: {e}", file=sys.stderr)
                    status = 2
                    continue
                key = _unique_key(name, used)
                tensors[key] = emb.contiguous()
                hashes[key] = data
                meta[key] = {"grid_thw": list(item.grid_thw), "tokens": item.num_tokens, "prompt": item.prompt}
                print(f"{key}: {item.num_tokens} tokens -> {list(emb.shape)} {str(emb.dtype).removeprefix('torch.')}")
    except (CheckpointError, PoolError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not tensors:
        return 2
    if args.format == "vllm-ec":
        from service.ec_export import write_ec
        from service.embed_cache import checkpoint_identity, content_hash

        checkpoint_id, options = checkpoint_identity(checkpoint), vision.options_key()
        for key, emb in tensors.items():
            path = write_ec(args.out, content_hash(hashes[key], options, checkpoint_id), emb)
            print(f"{key}: {path}")
    else:
        save_file(tensors, args.out, metadata={"kimi_vision": json.dumps(meta, sort_keys=True)})
    print(f"wrote {len(tensors)} embeddings to {args.out} in {time.perf_counter() - start:.2f} s")
    return status
