"""What several commands share: the model flags, the per-image limit flags (`vision.Limits`, for every
command that reads images) and reading an image file under them, the remote-image flags (`serve` and
`batch` fetch by the same rules), and resolving the checkpoint (the only place the embedded default
is chosen)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vision import Limits

_MEGAPIXEL = 1_000_000


def add_model_arguments(parser: argparse.ArgumentParser, *, devices: bool = True) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny model)")
    if devices:
        parser.add_argument("--devices", default="auto", metavar="SPEC",
                            help="encoder workers: auto (default), cpu:N or cuda:0,1,...")


def config_default(config: type, name: str) -> Any:
    """A config dataclass field's default: the one value a flag's default and help show."""
    spec = {f.name: f for f in dataclasses.fields(config)}[name]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """What keys vLLM's encoder cache: its model id and hash algorithm (keep them equal on both sides)."""
    parser.add_argument("--vllm-model-id", metavar="ID",
                        help="the model id vLLM runs (`vllm serve ID`), which keys its mm_hash of every image "
                             "(default: the checkpoint's _name_or_path, else moonshotai/Kimi-K3)")
    from service.engine.config import HASH_ALGORITHMS, EngineConfig

    default = config_default(EngineConfig, "hash_algorithm")
    parser.add_argument("--mm-hasher-algorithm", choices=HASH_ALGORITHMS, default=default,
                        help=f"vLLM's --mm-hasher-algorithm (default {default}, as vLLM's)")


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (else argparse's own error, naming the flag; exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = _at_least(1)
non_negative_int = _at_least(0)


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free port), got {value}")
    return value


def add_image_limit_arguments(parser: argparse.ArgumentParser, *, bounded_by: str | None = None,
                              note: str = "") -> None:
    """`--max-image-mb` and `--max-image-megapixels` (unset: `vision.DEFAULT_LIMITS`; < 1 is a usage
    error, exit 2). `bounded_by`: the flag whose value the default byte limit never exceeds (see
    `image_limits`); `note` ends both help texts."""
    from vision import DEFAULT_LIMITS

    default_mb = f"{DEFAULT_LIMITS.max_bytes >> 20}" + (f", or {bounded_by} if smaller" if bounded_by else "")
    parser.add_argument("--max-image-mb", type=positive_int, metavar="MB",
                        help=f"largest encoded image, in MiB (default {default_mb}){note}")
    parser.add_argument("--max-image-megapixels", type=positive_int, metavar="MP",
                        help="largest decoded image, width * height in millions of pixels (default "
                             f"{DEFAULT_LIMITS.max_pixels // _MEGAPIXEL}){note}")


def image_limits(args: argparse.Namespace, *, max_mb: int | None = None) -> Limits:
    """The per-image `vision.Limits` the flags give. `max_mb`: the value of `bounded_by` (serve's
    message limit, which every image travels in), which the default byte limit is lowered to."""
    from dataclasses import replace

    from vision import DEFAULT_LIMITS as default

    if args.max_image_mb is not None:
        max_bytes = args.max_image_mb << 20
    else:
        max_bytes = default.max_bytes if max_mb is None else min(default.max_bytes, max_mb << 20)
    mp = args.max_image_megapixels
    return replace(default, max_bytes=max_bytes, max_pixels=default.max_pixels if mp is None else mp * _MEGAPIXEL)


def read_image_file(path: str | os.PathLike[str], limits: Limits) -> bytes:
    """The bytes of the image file at `path`. A file whose size is over `limits.max_bytes` is refused
    (`ImageTooLargeError`, as the decoder words it) before it is read; one whose size `stat` cannot
    tell (a pipe) is read whole and the decoder checks it."""
    with open(path, "rb") as f:
        limits.check_encoded_size(os.fstat(f.fileno()).st_size)
        return f.read()


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_remote_image_arguments(parser: argparse.ArgumentParser, *, who: str) -> None:
    """`--allow-remote-images` and the rules its fetches follow (`service.fetch`, whose defaults
    these are); `who` names what may name the URLs ("HTTP requests", "input lines")."""
    from service.fetch import DEFAULT_CONCURRENCY, DEFAULT_MAX_REDIRECTS, DEFAULT_TIMEOUT_S

    parser.add_argument("--allow-remote-images", action="store_true",
                        help=f"let {who} name http(s) image URLs, which are then fetched: only public addresses "
                             "(loopback, private, link-local, multicast and reserved ones are refused, on every "
                             f"redirect hop; at most {DEFAULT_MAX_REDIRECTS}), under the per-image byte limit")
    parser.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                        help="with --allow-remote-images: fetch only from these hosts (exact names, as vLLM's "
                             "flag), wherever they resolve (default: any public host)")
    parser.add_argument("--media-fetch-timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds for the whole transfer of a request's remote images, fetched concurrently "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--max-media-fetches", type=positive_int, default=DEFAULT_CONCURRENCY, metavar="N",
                        help=f"remote image fetches at once, over all requests (default {DEFAULT_CONCURRENCY})")


def remote_image_problem(args: argparse.Namespace) -> str | None:
    if args.allowed_media_domains and not args.allow_remote_images:
        return "--allowed-media-domains needs --allow-remote-images (without it no URL is fetched at all)"
    return None


def checkpoint_dir(given: str | None) -> Path:
    """`--checkpoint`, or the embedded default (built on first use: a tiny random checkpoint)."""
    if given is not None:
        return Path(given)
    from service.checkpoints.default import default_checkpoint_dir

    return default_checkpoint_dir()
