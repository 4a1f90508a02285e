"""`kimi-vision checkpoint-path [--checkpoint DIR]`: the checkpoint directory `serve` loads, absolute.

It holds the tokenizer files (`tiktoken.model`, `tokenizer_config.json`) a client loads with
`transformers.AutoTokenizer.from_pretrained(DIR)` to count tokens as the server does (a benchmark
tool's `--tokenizer`): without `--checkpoint`, the embedded default, built first if this is its
first use, whose name in the cache changes with its generator.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="the checkpoint serve is given (default: the embedded default checkpoint)")


def run(args: argparse.Namespace) -> int:
    from service.cli.common import checkpoint_dir

    print(checkpoint_dir(args.checkpoint).resolve())
    return 0
