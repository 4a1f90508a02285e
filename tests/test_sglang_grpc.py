"""This service as a `grpc://` encoder of SGLang 0.5.23 (`--encoder-urls grpc://host:port`): a real
`kimi-vision serve` on 127.0.0.1 called by SGLang's own language-side gRPC code, imported from the
0.5.23 wheel fetched at test time (`sglang_receiver`; skipped offline), with the rows taken off
real ZMQ sockets by SGLang's receiver code:

- `zmq_to_tokenizer`: SGLang's `MMReceiverGrpc.encode` (the method its tokenizer awaits; run on an
  instance made without its `__init__`, which needs SGLang's running server, holding the two
  attributes the method reads: the encoder URLs and the language side's host) sends the Encode;
  the rows the tokenizer's socket receives equal the Embed RPC's bfloat16 rows bit for bit (two
  encodes: the server has no embedding cache);
- `zmq_to_scheduler`: two TP ranks register with SGLang's `_grpc_scheduler_receive_url`, one
  before the Encode and one while it waits; both get the rows; a rank registered by the HTTP route
  is one the gRPC Encode delivers to (one registration table for both faces);
- a bad image: SGLang's call fails with INVALID_ARGUMENT (what SGLang's own encoder answers for a
  400), and the tokenizer's socket gets SGLang's error EmbeddingData with the same message;
- a destination `--epd-allowed-destinations` does not allow: INVALID_ARGUMENT naming the rule,
  before the image is even decoded, and nothing connects there;
- the bounds and refusals of `/encode` on SGLang's generated stub; `Send` (mooncake) refused;
  the service's health and reflection.
"""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from images import png
from serve_process import ServeProcess
from sglang_receiver import Modality, bound_pull, check_rows, expected_rows, receive, receiver
from smg_grpc_proto import sglang_encoder_pb2 as spb
from smg_grpc_proto import sglang_encoder_pb2_grpc as spb_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
PHOTO = REPO_ROOT / "samples" / "photo.jpg"
IMAGES = [PHOTO.read_bytes(), png(150, 90, seed=1), png(64, 200, seed=2)]
SERVICE = "sglang.grpc.encoder.SglangEncoder"
pytestmark = pytest.mark.timeout(300)


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A `kimi-vision serve` (its gRPC port; the HTTP port for the shared-table test) and SGLang's
    grpc:// URL for it. No embedding cache: every call runs the tower, so the rows SGLang receives
    and the Embed RPC's they are compared with are two encodes."""
    with ServeProcess.start(["--devices", "cpu:1", "--http-port", "0", "--cache-mb", "0"],
                            log_path=tmp_path_factory.mktemp("sglang-grpc") / "serve.log") as proc:
        yield SimpleNamespace(proc=proc, url=f"grpc://{proc.target}")


@pytest.fixture(scope="module")
def expected(encoder):
    return expected_rows(encoder.proc.target, IMAGES)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def stub(encoder):
    """SGLang's generated client stub (what its `_grpc_encode_request` builds), for what its
    language side never sends."""
    with grpc.insecure_channel(encoder.proc.target) as channel:
        yield spb_grpc.SglangEncoderStub(channel)


def _language_side(encoder, host: str = "127.0.0.1") -> receiver.MMReceiverGrpc:
    """SGLang's gRPC receiver as its tokenizer holds it, for its `encode` only."""
    mm = object.__new__(receiver.MMReceiverGrpc)
    mm.encode_urls, mm.host = [encoder.url], host
    return mm


def _encode(encoder, req_id: str, images: list[bytes], embedding_port: int | None, **side) -> None:
    """What SGLang's language side does for a request's images: its `MMReceiverGrpc.encode`."""
    mm_data = [{"url": _url(data), "modality": Modality.IMAGE} for data in images]
    asyncio.run(_language_side(encoder, **side).encode(req_id, mm_data, embedding_port, "encode"))


def _register(encoder, req_id: str, port: int, count: int) -> None:
    """What one of SGLang's scheduler ranks does for a part (`WaitingZmqRequestGrpc`)."""
    asyncio.run(receiver._grpc_scheduler_receive_url(receiver._grpc_target(encoder.url), req_id,
                                                     f"127.0.0.1:{port}", count))


def test_zmq_to_tokenizer_rows_are_the_embed_rpcs(encoder, context, expected):
    sock, port = bound_pull(context)
    _encode(encoder, "gtok-1", IMAGES, port)
    check_rows(receive(sock, "gtok-1", timeout_s=30), [0, 1, 2], expected)


def test_zmq_to_scheduler_ranks_registered_before_and_during_the_encode(encoder, context, expected):
    ranks = [bound_pull(context) for _ in range(2)]
    _register(encoder, "gsched-1", ranks[0][1], 2)  # before the Encode
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_encode, encoder, "gsched-1", IMAGES[1:], None)
        first = receive(ranks[0][0], "gsched-1", timeout_s=60)  # the Encode is delivering now
        assert not pending.done()  # it waits for the second rank
        _register(encoder, "gsched-1", ranks[1][1], 2)
        second = receive(ranks[1][0], "gsched-1", timeout_s=30)
        pending.result(60)
    assert torch.equal(check_rows(first, [1, 2], expected).view(torch.int16),
                       check_rows(second, [1, 2], expected).view(torch.int16))


def test_one_registration_table_for_both_faces(encoder, context, expected):
    """A rank registered by the HTTP route gets the rows of the gRPC Encode of its part."""
    sock, port = bound_pull(context)
    registered = httpx.post(f"http://127.0.0.1:{encoder.proc.http_port}/scheduler_receive_url", timeout=30,
                            json={"req_id": "gboth-1", "receive_count": 1, "receive_url": f"127.0.0.1:{port}",
                                  "modality": "IMAGE"})
    assert registered.status_code == 200, registered.text
    _encode(encoder, "gboth-1", IMAGES[1:2], None)
    check_rows(receive(sock, "gboth-1", timeout_s=30), [1], expected)


def test_a_bad_image_is_invalid_argument_and_the_language_sides_error(encoder, context):
    sock, port = bound_pull(context)
    mm_data = [{"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
                "modality": Modality.IMAGE}]
    with pytest.raises(grpc.RpcError) as refused:
        asyncio.run(_language_side(encoder).encode("gbad-1", mm_data, port, "encode"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad image" in refused.value.details()
    error = receive(sock, "gbad-1", timeout_s=5)
    assert isinstance(error, receiver.EmbeddingData) and error.error_code == 400
    assert error.error_msg == refused.value.details()


def test_a_destination_not_allowed_is_refused_before_any_encode(encoder, context):
    """The language side names 127.0.0.3, neither the caller (127.0.0.1) nor listed: refused naming
    the rule, although the image is junk (the destination is checked first), and nothing connects."""
    far = context.socket(zmq.PULL)
    port = far.bind_to_random_port("tcp://127.0.0.3")
    with pytest.raises(grpc.RpcError) as refused:
        asyncio.run(_language_side(encoder, host="127.0.0.3").encode(
            "gfar-1", [{"url": _url(b"junk"), "modality": Modality.IMAGE}], port, "encode"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--epd-allowed-destinations peer; the caller is 127.0.0.1" in refused.value.details()
    assert not far.poll(1000)
    with pytest.raises(grpc.RpcError) as registration:
        asyncio.run(receiver._grpc_scheduler_receive_url(receiver._grpc_target(encoder.url), "gfar-2",
                                                         f"127.0.0.3:{port}", 1))
    assert registration.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not allowed by --epd-allowed-destinations" in registration.value.details()


def _request(**change) -> spb.EncodeRequest:
    fields = {"mm_items": [_url(IMAGES[1])], "req_id": "gref-1", "num_parts": 1, "part_idx": 0,
              "prefill_host": "127.0.0.1", "embedding_port": [5], **change}
    return spb.EncodeRequest(**fields)


@pytest.mark.parametrize(("change", "words"), [
    ({"req_id": ""}, "missing or invalid req_id"),
    ({"req_id": "r" * 257}, "req_id is over 256 bytes"),
    ({"mm_items": []}, "missing or empty mm_items"),
    ({"mm_items": [""]}, "an image's url must be a non-empty string"),
    ({"mm_items": ["/etc/passwd"]}, "does not read local files"),
    ({"num_parts": 0}, "num_parts must be a positive integer"),
    ({"num_parts": 2000}, "num_parts must be a positive integer up to 1024"),
    ({"part_idx": 1}, "part_idx must be in [0, 1)"),
    ({"embedding_port": list(range(1000, 1065))}, "at most 64"),
    ({"embedding_port": [70000]}, "embedding_port must be a port"),
    ({"prefill_host": ""}, "prefill_host is needed with an embedding_port"),
])
def test_refused_encode_requests(stub, change, words):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Encode(_request(**change), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert words in refused.value.details()


def test_refused_registrations(stub):
    for fields, words in (({"req_id": "g", "receive_url": "127.0.0.1:5", "receive_count": 0}, "receive_count"),
                          ({"req_id": "g", "receive_url": "nowhere", "receive_count": 1}, "host:port")):
        with pytest.raises(grpc.RpcError) as refused:
            stub.SchedulerReceiveUrl(spb.SchedulerReceiveUrlRequest(**fields), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()


def test_mooncake_send_is_refused(stub):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Send(spb.SendRequest(req_id="gmoon-1", prefill_host="127.0.0.1", embedding_port=5), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "mooncake" in refused.value.details()


def test_health_and_reflection_name_the_service(encoder):
    with grpc.insecure_channel(encoder.proc.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE in ProtoReflectionDescriptorDatabase(channel).get_services()
