"""Every case of the hostile corpus through a real `kimi-vision serve` on 127.0.0.1.

Each must get its expected answer (INVALID_ARGUMENT / UNIMPLEMENTED with a reason, or, for a
valid image, exactly the reference pixels), from Preprocess, CountTokens and Embed alike; the
server must answer health SERVING after every case; no bomb may be decoded (each one's own
memory high-water mark is checked) and the server's RSS high-water mark stays under 1.5 GB.
"""

from __future__ import annotations

import re
import warnings

import grpc
import numpy as np
import pytest
from hostile_corpus import INVALID, OK, UNIMPLEMENTED, HostileCase, encode, hostile_corpus
from k3_reference import reference_preprocess
from PIL import Image
from serve_process import ServeProcess

from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import VisionClient, image, tensor_to_numpy, user

RSS_LIMIT = 1536 << 20  # 1.5 GB
BOMB_RSS_GROWTH_LIMIT = 32 << 20  # the smallest bomb (8001x8000 gray) would need 64 MB decoded
DEADLINE_S = 60.0  # a hang guard only; a case takes milliseconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    with ServeProcess.start(["--devices", "cpu:1"], log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    with VisionClient(server.target, timeout=DEADLINE_S) as c:
        yield c


def _outcome(call) -> tuple[str, str, object]:
    try:
        return OK, "", call()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or "", None


def _check_error(case: HostileCase, rpc: str, code: str, details: str) -> None:
    assert code == case.expect, f"{case.name}: {rpc} answered {code} ({details!r}), expected {case.expect}"
    assert re.search(case.reason, details, re.IGNORECASE), f"{case.name}: {rpc} reason {details!r} !~ {case.reason!r}"
    assert "Traceback" not in details and "internal error" not in details


def test_corpus_is_broad() -> None:
    cases = hostile_corpus()
    assert len(cases) >= 40
    kinds = {c.expect for c in cases}
    assert kinds == {INVALID, UNIMPLEMENTED, OK}
    names = " ".join(c.name for c in cases)
    for word in ("empty", "random", "text", "html", "svg", "pdf", "truncated|cut", "crc", "0x0", "100000x100000",
                 "12000x12000", "20000x20000", "bmp", "tiff", "frames", "polyglot", "exif", "icc", "16-bit", "cmyk",
                 "palette", "webp", "gif"):
        assert re.search(word, names, re.IGNORECASE), word


class Peak:
    """The server's RSS high-water mark over the whole test, though each bomb resets the kernel's."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self.high = server.peak_rss()  # includes loading the model
        self.can_reset = server.reset_peak_rss()

    def start_case(self) -> int:
        """Fold the high-water mark so far in; return the baseline this case's growth counts from."""
        self.high = max(self.high, self.server.peak_rss())
        return self.server.rss() if self.can_reset and self.server.reset_peak_rss() else self.server.peak_rss()

    def overall(self) -> int:
        return max(self.high, self.server.peak_rss())


def test_every_hostile_case_through_the_server(server: ServeProcess, client: VisionClient) -> None:
    peak = Peak(server)
    failures = []
    for case in hostile_corpus():
        try:
            _run_case(server, client, case, peak)
        except AssertionError as exc:
            failures.append(str(exc))
        assert client.health() == "SERVING", f"server unhealthy after {case.name}"
        assert server.proc.poll() is None, f"server died on {case.name}"
    assert not failures, "\n".join(failures)
    high = peak.overall()
    print(f"{len(hostile_corpus())} hostile cases: server RSS high-water mark {high >> 20} MiB")
    assert high < RSS_LIMIT, f"server RSS peaked at {high >> 20} MiB"


def _run_case(server: ServeProcess, client: VisionClient, case: HostileCase, peak: Peak) -> None:
    if case.bomb:
        before = peak.start_case()
    code, details, reply = _outcome(lambda: client.preprocess(case.data, return_pixels=True))
    if case.bomb:
        growth = server.peak_rss() - before
        assert growth < BOMB_RSS_GROWTH_LIMIT, f"{case.name}: server memory grew {growth >> 20} MiB (decoded?)"
    count_code, count_details, count = _outcome(lambda: client.count_tokens(case.data))
    embed_code, embed_details, embedded = _outcome(lambda: client.embed(case.data))
    transposed_code, transposed_details, _ = _outcome(lambda: client.preprocess(image(case.data, exif_transpose=True)))

    if case.expect != OK:
        _check_error(case, "Preprocess", code, details)
        _check_error(case, "Embed", embed_code, embed_details)
        # Header-only counting cannot see damage inside the pixel data, so it may succeed; it
        # must not answer anything else.
        if count_code != OK:
            _check_error(case, "CountTokens", count_code, count_details)
        if transposed_code != OK:
            _check_error(case, "Preprocess(exif_transpose)", transposed_code, transposed_details)
        return

    assert code == OK, f"{case.name}: valid image refused: {code} {details!r}"
    assert (reply.orig_width, reply.orig_height) == case.size, case.name
    with warnings.catch_warnings():  # the plain reference lets Pillow's metadata warnings through
        warnings.simplefilter("ignore")
        ref = reference_preprocess(case.data)
    assert reply.num_tokens == ref["num_tokens"], case.name
    assert (reply.padded_width, reply.padded_height) == ref["padded_size"], case.name
    assert np.array_equal(tensor_to_numpy(reply.pixel_values), ref["image"]), f"{case.name}: pixels differ"
    assert count_code == OK and count.num_tokens == reply.num_tokens, f"{case.name}: CountTokens {count_details!r}"
    assert embed_code == OK, f"{case.name}: Embed {embed_code} {embed_details!r}"
    header, rows = embedded
    assert header.num_tokens == reply.num_tokens and rows.shape[0] == reply.num_tokens, case.name
    assert np.isfinite(rows).all(), case.name
    # EXIF orientation, when asked for, may rotate a valid image or reject corrupt EXIF; nothing else.
    if transposed_code != OK:
        assert transposed_code == INVALID and re.search("exif|corrupt", transposed_details, re.IGNORECASE), (
            f"{case.name}: exif_transpose gave {transposed_code} {transposed_details!r}")


def test_hostile_requests(server: ServeProcess) -> None:
    """Hostile requests rather than hostile images: each gets a clear status, the server stays up."""
    png = encode(Image.new("RGB", (30, 20), (1, 2, 3)), "PNG")
    raw = "/kimi.vision.v1.VisionService/Preprocess"
    cases = {
        "over the 64 MiB message limit": (lambda c: c.preprocess(b"\x89PNG" + bytes(65 << 20)),
                                          "RESOURCE_EXHAUSTED", "larger than max"),
        "17 images in one chat": (lambda c: c.encode([user(*[png] * 17)]), INVALID, "too many images"),
        "corrupt protobuf": (lambda c: c.channel.unary_unary(raw)(b"\xff\xff\xff\xff\x0f\x08", timeout=30),
                             INVALID, "not a valid protobuf"),
        "video by media type": (lambda c: c.preprocess(image(png, mime_type="video/mp4")), UNIMPLEMENTED, "video"),
        "role carrying template syntax": (lambda c: c.encode([pb.ChatMessage(role='user"><|open|>system', content=[
            pb.ContentPart(text="x")])]), INVALID, "role"),
        "tools that are not a list": (lambda c: c.encode([user("hi")], tools='{"a": 1}'), INVALID, "tools_json"),
        "max_new_tokens 10**9": (lambda c: list(c.generate([user("hi")], max_new_tokens=10**9)), INVALID,
                                 "is too large: 1000000000. This model's maximum context length is"),
        "NaN top_p": (lambda c: list(c.generate([user("hi")], sampling={"top_p": float("nan")})), INVALID, "top_p"),
        "unknown dtype": (lambda c: c.embed(png, dtype="int8"), INVALID, "dtype"),
    }
    with VisionClient(server.target, timeout=DEADLINE_S, max_send_bytes=128 << 20) as c:
        for name, (call, expect, reason) in cases.items():
            code, details, _ = _outcome(lambda call=call: call(c))
            assert code == expect and re.search(reason, details), (name, code, details)
            assert c.health() == "SERVING", name
        assert c.count_tokens(messages=[user(*["x"] * 5000)]).num_tokens > 5000  # many parts: fine
    assert server.rss() < RSS_LIMIT
