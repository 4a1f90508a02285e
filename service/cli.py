"""`kimi-vision` command line.

Each subcommand lives in its own module exposing `HELP`, `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their subcommand runs (or for `--help`),
so `kimi-vision preprocess` never pays for importing torch or grpc.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The help lives here so `kimi-vision --help` imports nothing.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("service.cmd_serve", "run the gRPC vision service (kimi.vision.v1.VisionService)"),
    "demo": ("service.cmd_demo", "start the service in-process and run images and a chat through it (gRPC)"),
    "preprocess": ("service.cmd_preprocess", "size, patch grid, token count and prompt Kimi-K3 makes of each image"),
    "preview": ("service.cmd_preview", "write the padded model-input image Kimi-K3 sees (optional token grid)"),
    "make-checkpoint": ("service.cmd_make_checkpoint", "write a deterministic random checkpoint in the Kimi-K3 layout"),
    "embed": ("service.cmd_embed", "encode images into Kimi-K3 image embeddings (safetensors)"),
    "render-chat": ("service.cmd_render_chat", "render a chat request into the Kimi-K3 prompt (and token ids)"),
    "params": ("service.cmd_params", "parameter counts, MXFP4 disk size and cache sizes of a model preset"),
    "quantize": ("service.cmd_quantize", "convert a bf16 checkpoint to MXFP4 (mxfp4-pack-quantized), K3 ignore list"),
    "batch": ("service.cmd_batch", "caption, OCR or embed many images (progress, exactly-once --resume, Ray)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-vision", description="Kimi-K3 vision service and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
