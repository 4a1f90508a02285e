"""This service as the encoder of SGLang 0.5.23's encoder disaggregation, through a real
`kimi-vision serve` on 127.0.0.1 and SGLang's own receiver code (`sglang_receiver`: its classes and
allow-listed unpickler, imported from the 0.5.23 wheel fetched at test time; skipped offline) on
real ZMQ sockets:

- both transfer backends from one server: `zmq_to_tokenizer` (the `/encode` names the port) and
  `zmq_to_scheduler` (two TP ranks register, one before the `/encode` and one after): the rows each
  receives equal the Embed RPC's bfloat16 rows bit for bit, SGLang's part validation takes every
  part, and each image's grid and original size are what K3's SGLang processor reads;
- a bad image is an error the language side has within a second, on the socket and in the answer;
- remote images are fetched by the chat route's rules (`--allowed-media-domains`, the image count
  before any fetch), from a real upstream on 127.0.0.1;
- the object on the wire is SGLang's EmbeddingData as its own encoder builds it, attribute for attribute;
- refusals (fields, video, mooncake, sizes over the bounds) and `/health`, `/health_generate`;
- the documented two-host deployment (loopback aliases): SGLang's routes on `--epd-port` only, both
  transports to a language side on 127.0.0.2 allowed by `--epd-allowed-destinations`, a third host
  neither joining nor breaking a registered part;
- a drain (SIGTERM) waits for a push still in flight: the language side gets its rows; a server
  stopped in its own process leaves no error report running on its loop.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import zmq
from image_upstream import ImageUpstream
from images import png
from serve_process import ServeProcess, free_port
from sglang_receiver import Modality, bound_pull, check_rows, expected_rows, receive, receiver, safe_pickle_loads

from service.engine import EngineConfig
from service.epd.sglang_wire import error_frames, part_frames
from service.server import ServerConfig, ServerThread
from vision.media import Modality as VisionModality

REPO_ROOT = Path(__file__).resolve().parent.parent
PHOTO = REPO_ROOT / "samples" / "photo.jpg"
pytestmark = pytest.mark.timeout(300)


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


IMAGES = [PHOTO.read_bytes(), png(150, 90, seed=1), png(64, 200, seed=2)]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A `kimi-vision serve --http-port` (SGLang's routes need nothing more; remote images from
    127.0.0.1 only, as the tests' upstream is allowed): the process and an HTTP client."""
    with (ServeProcess.start(["--devices", "cpu:1", "--http-port", "0", "--allow-remote-images",
                              "--allowed-media-domains", "127.0.0.1"],
                             log_path=tmp_path_factory.mktemp("sglang") / "serve.log") as proc,
          httpx.Client(base_url=f"http://127.0.0.1:{proc.http_port}", timeout=120) as http):
        yield SimpleNamespace(proc=proc, http=http)


@pytest.fixture(scope="module")
def http(encoder):
    return encoder.http


@pytest.fixture(scope="module")
def expected(encoder):
    return expected_rows(encoder.proc.target, IMAGES)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _encode_body(req_id: str, images: list[bytes], num_parts: int, part_idx: int, details: dict[int, str] | None = None,
                 **where) -> dict:
    """What SGLang's `MMReceiverHTTP.encode` posts for one part; `details`: the images (by their
    index in the part) whose OpenAI image part carried `detail`, which SGLang's language side forwards
    as a `{"url", "detail"}` item (`_extract_url_data`)."""
    details = details or {}
    items = [{"url": _url(d), "detail": details[i]} if i in details else _url(d) for i, d in enumerate(images)]
    return {"encoder_idx": 0, "encoder_url": "http://encoder", "mm_items": items,
            "num_parts": num_parts, "part_idx": part_idx, "req_id": receiver.create_part_req_id(req_id, part_idx),
            "modality": "IMAGE", "prefill_host": "127.0.0.1", "time_stats_json": None, **where}


def test_zmq_to_tokenizer_parts_arrive_as_the_rpcs_rows(http, context, expected):
    """Two parts of one request (two images, one of them with `detail: "high"`, then one) on the
    tokenizer's socket: `detail` changes nothing (K3's processor has one preprocessing)."""
    sock, port = bound_pull(context)
    bodies = [_encode_body("tok-1", IMAGES[:2], 2, 0, {1: "high"}, embedding_port=port),
              _encode_body("tok-1", IMAGES[2:], 2, 1, embedding_port=port)]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda body: http.post("/encode", json=body), bodies))
    assert [(r.status_code, r.json()) for r in replies] == [(200, None), (200, None)]
    check_rows(receive(sock, "tok-1", timeout_s=30), [0, 1, 2], expected)


def test_zmq_to_scheduler_two_ranks_registered_before_and_after_get_the_same_rows(http, context, expected):
    ranks = [bound_pull(context) for _ in range(2)]
    part_id = receiver.create_part_req_id("sched-1", 0)

    def register(rank: int) -> httpx.Response:  # what each TP rank's WaitingZmqRequest posts
        return http.post("/scheduler_receive_url", json={"req_id": part_id, "receive_count": 2, "modality": "IMAGE",
                                                         "receive_url": f"127.0.0.1:{ranks[rank][1]}"})

    assert register(0).status_code == 200  # before the /encode
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, "/encode", json=_encode_body("sched-1", IMAGES[:2], 1, 0, {0: "low"},
                                                                      embedding_port=None))
        first = receive(ranks[0][0], "sched-1", timeout_s=60)  # the /encode is delivering now
        assert not pending.done()  # it waits for the second rank
        assert register(1).status_code == 200  # after it
        second = receive(ranks[1][0], "sched-1", timeout_s=30)
        reply = pending.result(60)
    assert (reply.status_code, reply.json()) == (200, None)
    assert torch.equal(check_rows(first, [0, 1], expected).view(torch.int16), check_rows(second, [0, 1], expected)
                       .view(torch.int16))


def test_a_bad_image_is_the_language_sides_error_within_a_second(http, context):
    sock, port = bound_pull(context)
    start = time.monotonic()
    reply = http.post("/encode", json={**_encode_body("bad-1", [], 1, 0, embedding_port=port),
                                       "mm_items": [_url(b"not an image at all")]})
    error = receive(sock, "bad-1", timeout_s=1.0)
    assert time.monotonic() - start < 1.0
    assert reply.status_code == 400 and reply.json()["status"] == "error", reply.text
    assert reply.json()["req_id"] == receiver.create_part_req_id("bad-1", 0)
    assert isinstance(error, receiver.EmbeddingData) and error.error_code == 400
    assert "bad image" in error.error_msg and error.error_msg == reply.json()["message"]

    rank, rank_port = bound_pull(context)  # zmq_to_scheduler: the registered rank is told too
    part_id = receiver.create_part_req_id("bad-2", 0)
    assert http.post("/scheduler_receive_url", json={"req_id": part_id, "receive_count": 1, "modality": "IMAGE",
                                                     "receive_url": f"127.0.0.1:{rank_port}"}).status_code == 200
    start = time.monotonic()
    reply = http.post("/encode", json={**_encode_body("bad-2", [], 1, 0), "mm_items": [_url(b"GIF89a broken")]})
    error = receive(rank, "bad-2", timeout_s=1.0)
    assert time.monotonic() - start < 1.0 and reply.status_code == 400
    assert error.error_code == 400 and "bad image" in error.error_msg


def test_remote_images_are_fetched_by_the_chat_routes_rules(http, context, expected):
    """The face's one fetcher: a listed host's image arrives as the RPC's rows; a host not listed is
    refused without a connection, and too many images before any fetch; the language side is told."""
    sock, port = bound_pull(context)
    with ImageUpstream(IMAGES[1]) as upstream:
        reply = http.post("/encode", json={**_encode_body("remote-1", [], 1, 0, embedding_port=port),
                                           "mm_items": [upstream.url("/image.png")]})
        assert (reply.status_code, reply.json()) == (200, None), reply.text
        check_rows(receive(sock, "remote-1", timeout_s=30), [1], expected)
        fetched = upstream.hits["/image.png"]
        for req_id, items, status, words in (
                ("remote-2", [upstream.url("/image.png", host="localhost")], 400,
                 "allowed domains ['127.0.0.1']; this one is from 'localhost'"),
                ("remote-3", [upstream.url("/image.png")] * 17, 413, "too many images: 17")):
            reply = http.post("/encode", json={**_encode_body(req_id, [], 1, 0, embedding_port=port),
                                               "mm_items": items})
            assert reply.status_code == status and words in reply.json()["message"], reply.text
            error = receive(sock, req_id, timeout_s=5)
            assert error.error_code == status and error.error_msg == reply.json()["message"]
        assert upstream.hits["/image.png"] == fetched and "localhost" not in " ".join(upstream.hosts)


def test_the_wire_object_is_sglangs_embedding_data():
    """What SGLang's encoder sends (`_stage_embeddings`, then `copy_without_embedding`), built with
    SGLang's own class, equals what this service sends, attribute for attribute and in order."""
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    grid = torch.tensor([[1, 2, 6]], dtype=torch.int64)
    theirs = receiver.EmbeddingData("r_local_part_0", 1, 0, grid, Modality.IMAGE, rows, video_timestamps=None,
                                    second_per_grid_ts=None, original_image_sizes=[[80, 30]]).copy_without_embedding()
    frames = part_frames("r_local_part_0", 1, 0, VisionModality.IMAGE, rows, [(1, 2, 6)], [(80, 30)])
    ours = safe_pickle_loads(frames[0])
    assert type(ours) is receiver.EmbeddingData
    assert list(ours.__dict__) == list(theirs.__dict__)
    for key, value in theirs.__dict__.items():
        assert torch.equal(ours.grid_dim, value) if key == "grid_dim" else ours.__dict__[key] == value, key

    theirs = receiver.EmbeddingData("r_local_part_0", 1, 0, None, Modality.IMAGE, error_msg="bad image: x",
                                    error_code=400).copy_without_embedding()
    ours = safe_pickle_loads(error_frames("r_local_part_0", 1, 0, VisionModality.IMAGE, "bad image: x", 400)[0])
    assert ours.__dict__ == theirs.__dict__ and list(ours.__dict__) == list(theirs.__dict__)


@pytest.mark.parametrize(("change", "words"), [
    ({"req_id": ""}, "missing or invalid req_id"),
    ({"modality": "VIDEO"}, "takes still images only and rejects video"),
    ({"modality": "AUDIO"}, "modality AUDIO is not supported; Kimi-K3 takes images"),
    ({"mm_items": [{"url": "data:,", "detail": "ultra"}]}, "detail must be one of ['auto', 'low', 'high']"),
    ({"modality": "SMELL"}, "unsupported modality"),
    ({"num_parts": 0}, "num_parts must be a positive integer"),
    ({"part_idx": 1}, "part_idx must be in [0, 1)"),
    ({"mm_items": []}, "missing or empty mm_items"),
    ({"mm_items": [{"url": "data:,", "max_dynamic_patch": 6}]}, "max_dynamic_patch"),
    ({"mm_items": ["/etc/passwd"]}, "does not read local files"),
    ({"embedding_port": "x"}, "embedding_port"),
    ({"req_id": "r" * 257}, "req_id is over 256 bytes"),
    ({"num_parts": 10**30}, "num_parts must be a positive integer up to 1024"),
    ({"embedding_port": list(range(1000, 1065))}, "at most 64"),
])
def test_refused_encode_requests(http, change, words):
    reply = http.post("/encode", json={**_encode_body("refused", IMAGES[:1], 1, 0, embedding_port=5), **change})
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["status"] == "error" and words in body["message"], body


def test_mooncake_is_refused_and_ends_a_waiting_encode(http):
    part_id = receiver.create_part_req_id("moon-1", 0)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, "/encode", json=_encode_body("moon-1", IMAGES[1:2], 1, 0))
        for route in ("/scheduler_receive_meta_data", "/send"):
            refused = http.post(route, json={"req_id": part_id, "part_idx": 0})
            assert refused.status_code == 400 and "mooncake" in refused.json()["message"]
        reply = pending.result(60)
    assert reply.status_code == 400 and "mooncake" in reply.json()["message"], reply.text


def test_health(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


def test_a_drain_waits_for_a_push_in_flight(tmp_path, context):
    """SIGTERM while a part is pushed to two ports, one not listening yet: the server keeps draining
    (past what an idle server would take to stop) until the second port takes the rows, then the
    answer is 200 and the server exits 0."""
    first, first_port = bound_pull(context)
    second_port = free_port()
    with (ServeProcess.start(["--devices", "cpu:1", "--http-port", "0", "--drain-seconds", "30"],
                             log_path=tmp_path / "serve.log") as proc,
          httpx.Client(base_url=f"http://127.0.0.1:{proc.http_port}", timeout=120) as http,
          ThreadPoolExecutor(1) as pool):
        body = _encode_body("drain-1", IMAGES[1:2], 1, 0, embedding_port=[first_port, second_port])
        pending = pool.submit(http.post, "/encode", json=body)
        receive(first, "drain-1", timeout_s=60)  # the part is encoded and on its way
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(8)  # an idle server stops within STOP_GRACE_S and uvicorn's 5 s graceful shutdown
        assert proc.proc.poll() is None and not pending.done(), proc.log_text()[-2000:]
        second = context.socket(zmq.PULL)
        second.bind(f"tcp://127.0.0.1:{second_port}")
        assert receive(second, "drain-1", timeout_s=30).ready
        reply = pending.result(30)
        assert (reply.status_code, reply.json()) == (200, None), reply.text
        assert proc.proc.wait(60) == 0, proc.log_text()[-2000:]


def test_a_stopped_server_leaves_no_error_report_running(tiny_checkpoint):
    """An error report waiting for a language side that never listens is ended when the server stops."""
    with ServerThread(ServerConfig(port=0, http_port=0), EngineConfig(checkpoint=tiny_checkpoint,
                                                                      devices="cpu:1")) as handle:
        body = {**_encode_body("gone-1", [], 1, 0, embedding_port=free_port()), "mm_items": [_url(b"junk")]}
        reply = httpx.post(f"http://127.0.0.1:{handle.server.http_port}/encode", json=body, timeout=60)
        assert reply.status_code == 400, reply.text

        async def reports() -> int:
            return sum(task.get_coro().__qualname__ == "Pusher.deliver" for task in asyncio.all_tasks())

        assert handle.submit(reports()).result(10) == 1  # waiting for its peer (up to SEND_TIMEOUT_S)
    assert not [task for task in asyncio.all_tasks(handle.loop) if task.get_coro().__qualname__ == "Pusher.deliver"]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The documented two-host deployment on loopback aliases: the encoder on 127.0.0.1 with SGLang's
    routes on their own port (`--epd-port`), the language side on 127.0.0.2 (its tokenizer and
    ranks bind there), its /encode sent from 127.0.0.1 (another host than the one it names, so
    that host is allowed by `--epd-allowed-destinations`)."""
    with ServeProcess.start(["--devices", "cpu:1", "--http-port", "0", "--epd-port", "0",
                             "--epd-allowed-destinations", f"peer,{LANGUAGE_HOST}"],
                            log_path=tmp_path_factory.mktemp("two-hosts") / "serve.log") as proc:
        yield proc


LANGUAGE_HOST = "127.0.0.2"


def _client(port: int, source: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                        transport=httpx.HTTPTransport(local_address=source))


def test_epd_routes_on_their_own_port_only(two_hosts):
    with _client(two_hosts.http_port, "127.0.0.1") as public, _client(two_hosts.epd_port, "127.0.0.1") as epd:
        for path in ("/encode", "/scheduler_receive_url", "/send", "/scheduler_receive_meta_data"):
            assert public.post(path, json={}).status_code == 404, path
            assert epd.post(path, json={}).status_code == 400, path
        assert public.get("/health_generate").status_code == 404 and epd.get("/health_generate").status_code == 200
        assert epd.get("/v1/models").status_code == 404 and public.get("/v1/models").status_code == 200
        assert public.get("/health").status_code == epd.get("/health").status_code == 200


def test_both_transports_reach_another_host(two_hosts, context, expected):
    """zmq_to_tokenizer: the tokenizer on 127.0.0.2, named by an /encode from 127.0.0.1;
    zmq_to_scheduler: two ranks on 127.0.0.2 register from there. SGLang's receiver takes the rows."""
    def pull() -> tuple[zmq.Socket, int]:
        sock = context.socket(zmq.PULL)
        return sock, sock.bind_to_random_port(f"tcp://{LANGUAGE_HOST}")

    tokenizer, port = pull()
    with _client(two_hosts.epd_port, "127.0.0.1") as caller, _client(two_hosts.epd_port, LANGUAGE_HOST) as ranks:
        reply = caller.post("/encode", json=_encode_body("far-1", IMAGES[1:2], 1, 0, embedding_port=port,
                                                         prefill_host=LANGUAGE_HOST))
        assert (reply.status_code, reply.json()) == (200, None), reply.text
        check_rows(receive(tokenizer, "far-1", timeout_s=30), [1], expected)

        bound = [pull() for _ in range(2)]
        part_id = receiver.create_part_req_id("far-2", 0)
        for _, rank_port in bound:
            assert ranks.post("/scheduler_receive_url", json={
                "req_id": part_id, "receive_count": 2, "modality": "IMAGE",
                "receive_url": f"{LANGUAGE_HOST}:{rank_port}"}).status_code == 200
        # A third host can neither add itself to the part nor change its rank count.
        with _client(two_hosts.epd_port, "127.0.0.3") as stranger:
            for count in (2, 3):
                refused = stranger.post("/scheduler_receive_url", json={
                    "req_id": part_id, "receive_count": count, "modality": "IMAGE",
                    "receive_url": f"{LANGUAGE_HOST}:{bound[0][1]}"})
                assert refused.status_code == 400 and "another host" in refused.json()["message"], refused.text
        mismatch = ranks.post("/scheduler_receive_url", json={"req_id": part_id, "receive_count": 3,
                                                              "modality": "IMAGE",
                                                              "receive_url": f"{LANGUAGE_HOST}:{bound[0][1]}"})
        assert mismatch.status_code == 400 and "Inconsistent receive_count" in mismatch.json()["message"]
        reply = caller.post("/encode", json=_encode_body("far-2", IMAGES[:1], 1, 0, embedding_port=None))
        assert (reply.status_code, reply.json()) == (200, None), reply.text
        for sock, _ in bound:
            check_rows(receive(sock, "far-2", timeout_s=30), [0], expected)

        # Not on the list: 127.0.0.3 is neither the caller nor allowed.
        refused = caller.post("/encode", json=_encode_body("far-3", IMAGES[1:2], 1, 0, embedding_port=port,
                                                           prefill_host="127.0.0.3"))
        assert refused.status_code == 400 and "peer,127.0.0.2" in refused.json()["message"], refused.text
