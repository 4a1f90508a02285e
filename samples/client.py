"""A minimal client of a running `kimi-vision serve` (blocking API; see service/client.py for asyncio).

    kimi-vision serve --port 50051 &
    python samples/client.py --target 127.0.0.1:50051 samples/photo.jpg samples/sticker_rgba.png

For each image: its token count (header only), the preprocessing result and its embedding shape;
then one chat with all the images, streamed. Errors arrive as grpc.RpcError with a status code
and a reason (INVALID_ARGUMENT for a bad image, RESOURCE_EXHAUSTED when the server is full, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from service.rpc.client import VisionClient, user


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="+", type=Path)
    parser.add_argument("--target", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    parser.add_argument("--question", default="What do these images show?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    images = [path.read_bytes() for path in args.images]
    with VisionClient(args.target, timeout=300) as client:
        try:
            print("health:", client.health())
            for path, data in zip(args.images, images, strict=True):
                count = client.count_tokens(data).num_tokens
                info = client.preprocess(data)
                header, rows = client.embed(data, dtype="bfloat16")
                print(f"{path.name}: {info.orig_width}x{info.orig_height} -> {info.padded_width}x{info.padded_height}, "
                      f"{count} tokens, embedding {rows.shape} ({header.dtype}), hash {header.content_hash[:12]}")
            print(f"\nuser: {args.question}")
            for event in client.generate([user(args.question, *images)], max_new_tokens=args.max_new_tokens):
                kind = event.WhichOneof("event")
                if kind in ("reasoning_delta", "content_delta"):
                    print(getattr(event, kind), end="", flush=True)
                elif kind == "finish":
                    print(f"\n[{event.finish.usage.completion_tokens} tokens generated]")
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
