"""The per-image limit flags, `--max-image-mb` and `--max-image-megapixels`: made once
(`service.cli.common`), parsed and refused alike by every command that reads images, and applied by
each (real runs of preprocess, preview, embed and an in-process batch; on Ray: tests/test_batch_ray.py; serve
and batch --server: tests/test_serve_limits.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from images import MIB, check_limited_rows, limit_images, png

from service.cli import main as cli_main
from service.cli import serve
from service.cli.common import image_limits
from service.cli.main import build_parser
from vision import DEFAULT_LIMITS, plan_size

# What each command needs besides the flags under test to parse.
COMMANDS = {
    "serve": [],
    "batch": ["--task", "embed", "--input", "in", "--output", "out.jsonl"],
    "embed": ["--out", "out.safetensors", "a.png"],
    "preprocess": ["a.png"],
    "preview": ["a.png", "-o", "out.png"],
}


def _parse(command: str, *flags: str):
    argv = [command, *COMMANDS[command], *flags]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("flag", "value", "problem"), [
    ("--max-image-mb", "0", "must be >= 1, got 0"),
    ("--max-image-megapixels", "-3", "must be >= 1, got -3"),
    ("--max-image-mb", "1.5", "must be an integer, got '1.5'"),
])
def test_a_bad_limit_is_a_usage_error(command: str, flag: str, value: str, problem: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(command, flag, value)
    assert exit_info.value.code == 2
    assert f"kimi-vision {command}: error: argument {flag}: {problem}" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flags_make_the_limits(command: str) -> None:
    assert image_limits(_parse(command)) == DEFAULT_LIMITS
    given = image_limits(_parse(command, "--max-image-mb", "40", "--max-image-megapixels", "2"))
    assert given == dataclasses.replace(DEFAULT_LIMITS, max_bytes=40 * MIB, max_pixels=2_000_000)


def test_serve_checks_the_per_image_limit_against_the_message_limit() -> None:
    problem = serve._problem(_parse("serve", "--max-image-mb", "100", "--max-message-mb", "64"))
    assert problem.startswith("--max-image-mb 100 is larger than --max-message-mb 64")
    assert serve._problem(_parse("serve", "--max-image-mb", "64", "--max-message-mb", "64")) is None
    # Unset, the per-image limit is the default or the message limit, whichever is smaller.
    small = _parse("serve", "--max-message-mb", "4")
    assert serve._problem(small) is None
    assert image_limits(small, max_mb=small.max_message_mb).max_bytes == 4 * MIB
    assert image_limits(_parse("serve"), max_mb=64).max_bytes == DEFAULT_LIMITS.max_bytes


def test_batch_on_a_server_refuses_its_own_limits(capsys) -> None:
    rc = cli_main(["batch", *COMMANDS["batch"], "--server", "127.0.0.1:1", "--max-image-mb", "40"])
    assert rc == 2
    assert "--max-image-mb and --max-image-megapixels do not apply with --server" in capsys.readouterr().err


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return limit_images(tmp_path_factory.mktemp("limit-images"))


def test_preprocess_applies_the_limits(images: Path, capsys) -> None:
    rc = cli_main(["preprocess", "--json", "--max-image-mb", "40", "--max-image-megapixels", "1",
                   str(images / "35mb.png"), str(images / "1200x1000.png")])
    small, large = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert rc == 2
    assert small["tokens"] == plan_size(64, 48).num_tokens
    assert "over the 1,000,000-pixel limit" in large["error"]
    rc = cli_main(["preprocess", "--json", str(images / "35mb.png")])
    assert rc == 2
    assert "over the per-image byte limit (33,554,432 bytes)" in json.loads(capsys.readouterr().out)["error"]


def test_preview_applies_the_limits(images: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.png"
    rc = cli_main(["preview", "--max-image-mb", "40", str(images / "35mb.png"), "-o", str(out)])
    assert rc == 0 and f"{plan_size(64, 48).num_tokens} tokens" in capsys.readouterr().out
    rc = cli_main(["preview", str(images / "35mb.png"), "-o", str(out)])
    assert rc == 2
    assert "over the per-image byte limit (33,554,432 bytes)" in capsys.readouterr().err
    rc = cli_main(["preview", "--max-image-megapixels", "1", str(images / "1200x1000.png"), "-o", str(out)])
    assert rc == 2 and "over the 1,000,000-pixel limit" in capsys.readouterr().err


def test_embed_applies_the_limits(images: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.safetensors"
    rc = cli_main(["embed", "--workers", "1", "--max-image-mb", "40", "--max-image-megapixels", "1", "--out", str(out),
                   str(images / "35mb.png"), str(images / "1200x1000.png")])
    captured = capsys.readouterr()
    assert rc == 2  # one input failed; the other is written
    assert f"{images / '35mb.png'}: {plan_size(64, 48).num_tokens} tokens" in captured.out
    assert f"error: {images / '1200x1000.png'}: " in captured.err and "1,000,000-pixel limit" in captured.err
    assert out.exists()


def test_a_file_over_the_byte_limit_is_refused_before_it_is_read(tmp_path: Path, capsys) -> None:
    """A sparse file of 1 TiB: reading it whole cannot succeed here, so each command refuses it by its size."""
    huge = tmp_path / "huge.png"
    huge.write_bytes(png(8, 8))
    os.truncate(huge, 1 << 40)
    refused = "encoded image is 1,099,511,627,776 bytes, over the per-image byte limit (33,554,432 bytes)"
    assert cli_main(["preprocess", "--json", str(huge)]) == 2
    assert refused in json.loads(capsys.readouterr().out)["error"]
    assert cli_main(["preview", str(huge), "-o", str(tmp_path / "out.png")]) == 2
    assert f"kimi-vision preview: {huge}: {refused}" in capsys.readouterr().err
    assert cli_main(["embed", "--workers", "1", "--out", str(tmp_path / "out.safetensors"), str(huge)]) == 2
    assert f"error: {huge}: bad image: {refused}" in capsys.readouterr().err


def test_batch_in_process_applies_the_limits(images: Path, tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    rc = cli_main(["batch", "--task", "embed", "--input", str(images), "--output", str(output), "--devices", "cpu:1",
                   "--max-image-mb", "40", "--max-image-megapixels", "1"])
    assert rc == 0
    check_limited_rows(output)
