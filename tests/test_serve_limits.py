"""`kimi-vision serve`'s size limits are separate, as their flags say: `--max-message-mb` bounds a
request message (all its images together), `--max-image-mb` each encoded image, and raising the
first never raises the second. Real server processes on 127.0.0.1."""

from __future__ import annotations

import struct
import zlib

import grpc
import pytest
from serve_process import ServeProcess

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
