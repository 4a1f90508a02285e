"""`kimi-vision demo`: the whole service end to end, in one command.

Starts the gRPC server in this process on a free 127.0.0.1 port, then acts as its client:
Preprocess and Embed for every image in `samples/` (or the given files), one Encode of a chat
holding two of them, and one Generate whose reply is streamed to the terminal. Every step goes
through gRPC; latencies are wall-clock client-side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from service.cli.common import add_model_arguments, checkpoint_dir

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff"}
SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", metavar="FILE", help="images (default: the files in samples/)")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=24, metavar="N", help="reply length cap (default 24)")
    parser.add_argument("--prompt", default="Describe these two images in one sentence.", help="the chat's question")


def _printable(text: str) -> str:
    """Control characters (random weights produce them) as escapes, so they cannot upset the terminal."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode() for c in text)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    paths = [Path(f) for f in args.files] or sorted(p for p in SAMPLES.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        print(f"error: no images given and none found in {SAMPLES}", file=sys.stderr)
        return 2
    images = []
    for path in paths:
        try:
            images.append((path.name, path.read_bytes()))
        except OSError as exc:
            print(f"error: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2

    import grpc

    from service.engine import EngineConfig
    from service.rpc._proto import vision_pb2 as pb
    from service.rpc.client import VisionClient, user
    from service.server import ServerConfig, ServerThread

    print("kimi-vision demo: starting the gRPC service in this process ...", flush=True)
    start = time.perf_counter()
    handle = ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=checkpoint_dir(args.checkpoint),
                                                             devices=args.devices))
    try:
        handle.wait_ready()
    except Exception as exc:  # noqa: BLE001 - a bad checkpoint or device spec is reported, not a traceback
        handle.stop()
        print(f"error: the service did not start: {exc}", file=sys.stderr)
        return 1
    engine = handle.engine
    print(f"serving kimi.vision.v1.VisionService on {handle.target} after {time.perf_counter() - start:.1f} s "
          f"(checkpoint {engine.checkpoint_dir}, {len(engine.devices)} encoder worker(s) on "
          f"{', '.join(sorted(set(engine.devices)))}, hidden size {engine.hidden_size})")
    if args.checkpoint is None:
        print("NOTE: these are the embedded default weights, a tiny RANDOM checkpoint: token counts, shapes and "
              "the plumbing are real, but the embeddings and the generated reply are meaningless noise.")
    status = 0
    try:
        with VisionClient(handle.target, timeout=600) as client:
            print(f"\nhealth: {client.health()}\n")
            print(f"{'image':<24} {'size':>11} {'tokens':>6}  {'Preprocess':>11}  {'embedding':>12}  {'Embed':>11}")
            ok = []
            for name, data in images:
                try:
                    t0 = time.perf_counter()
                    pre = client.preprocess(data)
                    t1 = time.perf_counter()
                    header, rows = client.embed(data)
                    t2 = time.perf_counter()
                except grpc.RpcError as exc:
                    print(f"{name:<24} {exc.code().name}: {exc.details()}")
                    status = 2
                    continue
                ok.append((name, data))
                size, shape = f"{pre.orig_width}x{pre.orig_height}", str(rows.shape)
                print(f"{name:<24} {size:>11} {pre.num_tokens:>6}  {_ms(t1 - t0)}  {shape:>12}  {_ms(t2 - t1)}")
            if not ok:
                return 2
            pair = ok[:2]
            chat = [user(args.prompt, *[data for _, data in pair])]
            t0 = time.perf_counter()
            encoded = client.encode(chat)
            t1 = time.perf_counter()
            spans = ", ".join(f"{n} at {s.offset} (+{s.length})" for (n, _), s in zip(pair, encoded.header.spans,
                                                                                        strict=True))
            print(f"\nEncode ({_ms(t1 - t0).strip()}): {len(encoded.input_ids)} prompt ids with each media_pad "
                  f"expanded; image rows {encoded.embeddings.shape} at {spans}")
            print(f"\nGenerate: user: {args.prompt!r} + {', '.join(n for n, _ in pair)}")
            t0 = time.perf_counter()
            first = None
            protocol_errors = 0
            for event in client.generate(chat, max_new_tokens=args.max_new_tokens,
                                         sampling={"temperature": 0.0}):
                kind = event.WhichOneof("event")
                if first is None:
                    first = time.perf_counter() - t0
                if kind in ("reasoning_delta", "content_delta"):
                    print(_printable(getattr(event, kind)), end="", flush=True)
                elif kind == "protocol_error":
                    protocol_errors += 1  # output that breaks the K3 grammar: counted, shown at the end
                elif kind == "finish":
                    f = event.finish
                    if protocol_errors:
                        print(f"\n[{protocol_errors} stretches of output broke the K3 output grammar "
                              "(stray control tokens), as random weights do]", end="")
                    reason = "end_of_msg" if f.reason == pb.FINISH_REASON_STOP else "max_new_tokens"
                    print(f"\n[finish: {reason}; prompt {f.usage.prompt_tokens} tokens ({f.usage.image_tokens} image), "
                          f"generated {f.usage.completion_tokens}; first event {_ms(first).strip()}, "
                          f"total {_ms(time.perf_counter() - t0).strip()}]")
                else:
                    print(f"\n[{kind}: {_printable(str(getattr(event, kind)).strip())}]", end="")
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        status = 1
    finally:
        handle.stop()
    if args.checkpoint is None:
        print("\n(Reminder: random default weights, so the reply above is noise. Point --checkpoint at real "
              "Kimi-K3 weights for real answers.)")
    return status
