"""`kimi-vision` command line.

Each subcommand lives in its own module of this package exposing `add_arguments(parser)` and
`run(args) -> int`; its one-line help lives in the table below, the only place. Modules are
imported only when their subcommand runs (or for its `--help`), and import what is heavy inside
`run`, so `kimi-vision preprocess` never pays for importing torch or grpc.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The help lives here so `kimi-vision --help` imports nothing.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("service.cli.serve", "run the gRPC vision service (kimi.vision.v1.VisionService)"),
    "demo": ("service.cli.demo", "start the service in-process and run images and a chat through it (gRPC)"),
    "preprocess": ("service.cli.preprocess", "size, patch grid, token count and prompt Kimi-K3 makes of each image"),
    "preview": ("service.cli.preview", "write the padded model-input image Kimi-K3 sees (optional token grid)"),
    "make-checkpoint": ("service.cli.make_checkpoint", "write a deterministic random checkpoint in the Kimi-K3 layout"),
    "embed": ("service.cli.embed", "encode images into Kimi-K3 image embeddings (safetensors)"),
    "render-chat": ("service.cli.render_chat", "render a chat request into the Kimi-K3 prompt (and token ids)"),
    "params": ("service.cli.params", "parameter counts, MXFP4 disk size and cache sizes of a model preset"),
    "quantize": ("service.cli.quantize", "convert a bf16 checkpoint to MXFP4 (mxfp4-pack-quantized), as released"),
    "batch": ("service.cli.batch", "caption, OCR or embed many images (progress, exactly-once --resume, Ray)"),
    "checkpoint-path": ("service.cli.checkpoint_path", "print the checkpoint directory serve loads (its tokenizer: "
                        "what a benchmark tool's --tokenizer takes)"),
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
