"""`kimi-vision serve`'s size limits are separate, as their flags say: `--max-message-mb` bounds a
request message (all its images together), `--max-image-mb` each encoded image, and raising the
first never raises the second; a per-image limit the message limit cannot carry is refused. A
`kimi-vision batch --server` job reads its images under the limits the server reports. Real server
and batch processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import grpc
import pytest
from images import MIB, padded_png
from serve_process import REPO_ROOT, ServeProcess, serve_command

from service.rpc.client import VisionClient
from vision import plan_size

IMAGE_BYTES = 40 << 20  # over the 32 MiB per-image default, under a 64 MiB message


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def forty_mb_png() -> bytes:
    """A valid 2000x2000 PNG header followed by 40 MB of (never decoded) pixel data."""
    head = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 2000, 2000, 8, 2, 0, 0, 0))
    tail = _chunk(b"IEND", b"")
    body = IMAGE_BYTES - len(head) - len(tail) - 12
    return head + _chunk(b"IDAT", bytes(body)) + tail


@pytest.fixture(scope="module")
def data() -> bytes:
    payload = forty_mb_png()
    assert len(payload) == IMAGE_BYTES
    return payload


def _serve(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> ServeProcess:
    log = tmp_path_factory.mktemp("limits") / "serve.log"
    return ServeProcess.start(["--devices", "cpu:1", *flags], log_path=log)


def test_a_larger_message_limit_keeps_the_per_image_default(tmp_path_factory, data: bytes) -> None:
    with _serve(tmp_path_factory, "--max-message-mb", "64") as server, \
            VisionClient(server.target, timeout=120) as client:
        for call in (client.count_tokens, client.preprocess, client.embed):
            with pytest.raises(grpc.RpcError) as info:
                call(data)
            err = info.value
            # The message went through (64 MB is allowed): the image itself is refused, by name.
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (call.__name__, err.details())
            assert "per-image byte limit (33,554,432 bytes)" in err.details(), err.details()
            assert "41,943,040 bytes" in err.details()
        assert client.health() == "SERVING"


def test_the_per_image_limit_has_its_own_flag(tmp_path_factory, data: bytes) -> None:
    with _serve(tmp_path_factory, "--max-message-mb", "64", "--max-image-mb", "48") as server, \
            VisionClient(server.target, timeout=120) as client:
        assert client.count_tokens(data).num_tokens == plan_size(2000, 2000).num_tokens  # the header is read


def _embed_job(images: Path, output: Path, *args: str) -> dict[str, dict]:
    """Run `kimi-vision batch --task embed` on a directory; its rows by custom_id."""
    done = subprocess.run([sys.executable, "-m", "service.cli", "batch", "--task", "embed", "--input", str(images),
                           "--output", str(output), *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr  # per-image failures are rows; none is transient
    return {row["custom_id"]: row for row in map(json.loads, output.read_text().splitlines())}


def _refused(row: dict, limit: str) -> str:
    assert (row["response"]["status_code"], row["error"]["code"]) == (413, "too_large"), row
    assert limit in row["error"]["message"], row["error"]["message"]
    return row["error"]["message"]


def test_batch_on_a_server_reads_images_under_the_servers_limits(tmp_path_factory, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "35mb.png").write_bytes(padded_png(35 * MIB))
    (images / "exactly_40mib.png").write_bytes(padded_png(40 * MIB))  # at the per-image limit
    (images / "over_40mib.png").write_bytes(padded_png(40 * MIB + 1))
    with _serve(tmp_path_factory, "--max-image-mb", "40", "--max-message-mb", "40") as server:
        with VisionClient(server.target, timeout=60) as client:
            info = client.model_info()
        assert (info.max_image_bytes, info.max_image_pixels, info.max_message_bytes) == (40 * MIB, 64_000_000,
                                                                                           40 * MIB)
        rows = _embed_job(images, tmp_path / "server.jsonl", "--server", server.target)
    assert rows["35mb.png"]["response"]["status_code"] == 200, rows["35mb.png"]["error"]
    assert rows["35mb.png"]["response"]["body"]["usage"]["prompt_tokens"] == plan_size(64, 48).num_tokens
    # Read whole (it is within the per-image limit), but a request carrying it is larger than the
    # message limit: refused before it is sent, naming that limit.
    _refused(rows["exactly_40mib.png"], "over the server's message limit of 41,943,040 bytes")
    _refused(rows["over_40mib.png"], "over the per-image limit of 41,943,040 bytes")

    # The same 35 MB image, in-process with the default limits: refused as too large.
    default = tmp_path / "default"
    default.mkdir()
    os.link(images / "35mb.png", default / "35mb.png")
    rows = _embed_job(default, tmp_path / "default.jsonl")
    _refused(rows["35mb.png"], "over the per-image limit of 33,554,432 bytes")


def test_a_per_image_limit_over_the_message_limit_is_refused() -> None:
    done = subprocess.run([*serve_command(), "serve", "--port", "0", "--max-image-mb", "100", "--max-message-mb", "64"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --max-image-mb 100 is larger than --max-message-mb 64"), done.stderr
