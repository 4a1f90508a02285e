"""What several commands share: the model flags, and resolving the checkpoint (the only place the
embedded default is chosen)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_arguments(parser: argparse.ArgumentParser, *, devices: bool = True) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny model)")
    if devices:
        parser.add_argument("--devices", default="auto", metavar="SPEC",
                            help="encoder workers: auto (default), cpu:N or cuda:0,1,...")


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """What keys vLLM's encoder cache: its model id and hash algorithm (keep them equal on both sides)."""
    parser.add_argument("--vllm-model-id", metavar="ID",
                        help="the model id vLLM runs (`vllm serve ID`), which keys its mm_hash of every image "
                             "(default: the checkpoint's _name_or_path, else moonshotai/Kimi-K3)")
    parser.add_argument("--mm-hasher-algorithm", choices=("blake3", "sha256", "sha512"), default="blake3",
                        help="vLLM's --mm-hasher-algorithm (default blake3, as vLLM's)")


def checkpoint_dir(given: str | None) -> Path:
    """`--checkpoint`, or the embedded default (built on first use: a tiny random checkpoint)."""
    if given is not None:
        return Path(given)
    from service.checkpoints.default import default_checkpoint_dir

    return default_checkpoint_dir()
