"""Careless and hostile traffic through a real `kimi-vision serve` on 127.0.0.1 (HTTP, gRPC and a
batch job on it), with a real image upstream on 127.0.0.1 (`--allowed-media-domains 127.0.0.1` is
how it is allowed): every request's cost is bounded before the work starts.

- the model length (`--max-model-len`) on every face, before any pixel is decoded; `max_tokens`
  absent is what the prompt leaves;
- a client that goes away, streaming or not, during its body or its answer, stops its work;
- remote images: every cheap check before the first fetch, fetched at once, within one deadline,
  outside the work slots, by the SSRF rules on every hop;
- HTTP hygiene: slow heads and bodies get 408 and are closed, bodies are admitted before they are
  read, 431, 400, every error an OpenAI object, HEAD /health, metric labels from fixed sets;
- no sampling value gives a 5xx on any face; auth in the taxonomy, on every face and in batch jobs.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import secrets
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from image_upstream import ImageUpstream
from openai_schema import ChatCompletion, ErrorResponse
from PIL import Image
from serve_process import REPO_ROOT, ServeProcess

from service.auth import ENV_VAR
from service.errors import KIND_METADATA
from service.rpc._proto import vision_pb2 as pb
from service.rpc.auth import bearer_credentials
from service.rpc.client import VisionClient, user

pytestmark = pytest.mark.timeout(600)

TOKEN = secrets.token_urlsafe(24)
MODEL_LEN = 4096
HEAD_TIMEOUT_S = BODY_TIMEOUT_S = 1.0
FETCH_TIMEOUT_S = 3.0
ARGS = ["--devices", "cpu:1", "--http-port", "0", "--metrics-port", "0", "--log-format", "json",
        "--max-model-len", str(MODEL_LEN), "--allow-remote-images", "--allowed-media-domains", "127.0.0.1",
        "--media-fetch-timeout", str(FETCH_TIMEOUT_S), "--http-header-timeout", str(HEAD_TIMEOUT_S),
        "--http-body-timeout", str(BODY_TIMEOUT_S), "--max-concurrency", "1", "--max-queue", "6",
        "--max-bodies-in-flight", "2"]


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png(28, 28)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(*urls: str, text: str = "What is it?", **extra) -> dict:
    parts = [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def upstream():
    with ImageUpstream(PNG) as up:
        yield up


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile-traffic") / "serve.log"
    with ServeProcess.start(ARGS, log_path=log, env={ENV_VAR: TOKEN}) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120,
                      headers={"authorization": f"Bearer {TOKEN}"}) as client:
        yield client


@pytest.fixture(scope="module")
def rpc(server):
    with VisionClient(server.target, timeout=120, credentials=bearer_credentials(TOKEN)) as client:
        yield client


def _error(reply: httpx.Response, status: int, words: str) -> str:
    assert reply.status_code == status, reply.text
    error = ErrorResponse.model_validate(reply.json()).error
    assert error.code == status and words in error.message, error.message
    return error.message


def _metrics(server: ServeProcess) -> str:
    return httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _records(server: ServeProcess) -> list[dict]:
    return [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]


def _access(server: ServeProcess, request_id: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [r for r in _records(server) if r.get("request_id") == request_id and "status" in r]
        if lines:
            return lines[-1]
        time.sleep(0.1)
    raise AssertionError(f"no access line for {request_id}")


def _batch(server: ServeProcess, tmp_path: Path, lines: list[dict], *args: str,
           env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    run = tmp_path / secrets.token_hex(4)  # a fresh job each time
    run.mkdir()
    source, output = run / "lines.jsonl", run / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "service.cli", "batch", "--task", "caption", "--input", str(source),
                           "--output", str(output), "--server", server.target, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240, env={**_env(), **(env or {})})
    rows = [json.loads(line) for line in output.read_text().splitlines()] if output.exists() else []
    return done, rows


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != ENV_VAR}


# ---------------------------------------------------------------------------------------------
# The model length


def _prompt_tokens(http: httpx.Client, body: dict) -> int:
    reply = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


def test_the_model_length_bounds_every_face_before_any_pixel(http, rpc, server, tmp_path):
    big = _png(2000, 2000)  # 5,184 image tokens, over the 4,096 of --max-model-len
    counted = rpc.count_tokens(messages=[user("What is it?", big)]).num_tokens
    before = _metrics(server)
    message = _error(http.post("/v1/chat/completions", json=_chat(_data_url(big))), 400,
                     f"This model's maximum context length is {MODEL_LEN} tokens. However, your request has ")
    asked = int(message.split("has ")[1].split(" ")[0])
    assert counted <= asked <= counted + 8  # the prompt as generation sees it (its generation prompt too)
    after = _metrics(server)
    for never_reached in ("kimi_vision_embed_cache_lookups_total", 'kimi_vision_tokens_total{kind="image"}'):
        assert _sample(after, never_reached) == _sample(before, never_reached), never_reached  # no pixel decoded

    text = {"messages": [{"role": "user", "content": "Say hi."}]}
    prompt = _prompt_tokens(http, text)
    too_many = MODEL_LEN - prompt + 1
    expected = (f"'max_tokens' or 'max_completion_tokens' is too large: {too_many}. This model's maximum context "
                f"length is {MODEL_LEN} tokens and your request has {prompt} input tokens ({too_many} > "
                f"{MODEL_LEN} - {prompt}).")
    assert _error(http.post("/v1/chat/completions", json={**text, "max_tokens": too_many}), 400, "") == expected
    assert http.post("/v1/chat/completions", json={**text, "max_tokens": 2}).status_code == 200
    with pytest.raises(grpc.RpcError) as info:
        list(rpc.generate([user("What is it?", big)], max_new_tokens=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == message
    early = _error(http.post("/v1/chat/completions", json={**text, "max_tokens": MODEL_LEN}), 400, "too large")
    with pytest.raises(grpc.RpcError) as info:
        list(rpc.generate([user("Say hi.")], max_new_tokens=MODEL_LEN))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == early

    # A batch line (thinking off: a shorter prompt) over the length is its error row, in the same words.
    done, rows = _batch(server, tmp_path, [{"custom_id": "long", "body": {**text, "max_tokens": MODEL_LEN - 1}}],
                        env={ENV_VAR: TOKEN})
    assert done.returncode == 0, done.stderr
    (row,) = rows
    assert row["response"]["status_code"] == 400 and row["error"]["code"] == "bad_input"
    assert row["error"]["message"].startswith(f"line 1: 'max_tokens' or 'max_completion_tokens' is too large: "
                                              f"{MODEL_LEN - 1}. This model's maximum context length is {MODEL_LEN} "
                                              "tokens and your request has ")


def test_max_tokens_absent_is_what_the_prompt_leaves(http):
    def body(words: int) -> dict:
        return {"messages": [{"role": "user", "content": "hello " * words}]}

    base, step = _prompt_tokens(http, body(0)), _prompt_tokens(http, body(100)) - _prompt_tokens(http, body(0))
    words = (MODEL_LEN - 3 - base) * 100 // step
    prompt = _prompt_tokens(http, body(words))
    assert MODEL_LEN - 60 < prompt < MODEL_LEN
    reply = ChatCompletion.model_validate(http.post("/v1/chat/completions", json=body(words)).json())
    assert reply.usage.prompt_tokens == prompt
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.total_tokens == MODEL_LEN
    else:
        assert reply.usage.total_tokens < MODEL_LEN


# ---------------------------------------------------------------------------------------------
# Cancellation


def test_a_client_that_leaves_stops_its_work(http, server):
    """One work slot: a non-streaming generation of thousands of tokens whose client gives up at 2 s
    must free the slot and the trunk at once (the next request is answered in well under what the
    rest of the first would take), and the access log says 499, with no traceback."""
    long = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3500}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=long, timeout=2, headers={"x-request-id": "gone-at-2s"})
    assert time.monotonic() - start < 4
    start = time.monotonic()
    assert http.post("/v1/chat/completions", json=_chat(_data_url(PNG))).status_code == 200
    assert time.monotonic() - start < 10
    assert _access(server, "gone-at-2s")["status"] == "499"

    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:  # gone while sending the body
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: gone-in-body\r\n"
                     + f"authorization: Bearer {TOKEN}\r\ncontent-length: 1000\r\n\r\n".encode() + b"{" * 10)
        time.sleep(0.3)
    assert _access(server, "gone-in-body")["status"] == "499"
    log = server.log_text()
    assert "Traceback" not in log and '"level": "ERROR"' not in log


# ---------------------------------------------------------------------------------------------
# Remote images


def test_every_cheap_check_comes_before_the_first_fetch(http, upstream):
    slow = upstream.url("/drip/5")
    cases = [(_chat(*[slow] * 17), 413, "too many images: 17"), (_chat(slow, model="gpt-4o"), 404, "gpt-4o"),
             (_chat(slow, top_p=5), 400, "top_p must be in (0, 1]"),
             (_chat(slow, max_tokens=MODEL_LEN), 400, "'max_tokens' or 'max_completion_tokens' is too large"),
             (_chat(slow, tools=[{"type": "function"}]), 400, "tools[0].function is required")]
    for body, status, words in cases:
        start = time.monotonic()
        _error(http.post("/v1/chat/completions", json=body), status, words)
        assert time.monotonic() - start < 1.5, words
    assert upstream.hits["/drip/5"] == 0


def test_images_are_fetched_at_once_outside_the_work_slots(http, upstream):
    start = time.monotonic()
    assert http.post("/v1/chat/completions", json=_chat(*[upstream.url("/drip/1")] * 4)).status_code == 200
    assert time.monotonic() - start < 2.8  # four 1-s transfers at once
    # Two requests fetching slow images hold no work slot (there is one): a text request goes first.
    slow = [threading.Thread(target=http.post, args=("/v1/chat/completions",),
                             kwargs={"json": _chat(upstream.url("/drip/2.5"))}) for _ in range(2)]
    for thread in slow:
        thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    assert http.post("/v1/chat/completions", json=_chat(text="Say hi.")).status_code == 200
    assert time.monotonic() - start < 1.5
    for thread in slow:
        thread.join()
    start = time.monotonic()  # the deadline is the whole transfer's: every read of a drip gets data
    _error(http.post("/v1/chat/completions", json=_chat(upstream.url("/drip/8"))), 503,
           f"within {FETCH_TIMEOUT_S:g} s")
    assert FETCH_TIMEOUT_S - 0.2 < time.monotonic() - start < FETCH_TIMEOUT_S + 2


def test_the_fetch_rules_through_the_server(http, upstream, server):
    """Bad input (400, not retried) for what can never work; 503 only for the network of an allowed host."""
    cases = [(upstream.url("/to", "file:///etc/passwd"), 400, "redirected to a file: URL"),
             (upstream.url("/to", "ftp://example.com/x.png"), 400, "redirected to a ftp: URL"),
             (upstream.url("/to", upstream.url("/image.png", host="localhost")), 400, "allowed domains"),
             (upstream.url("/image.png", host="localhost"), 400, "allowed domains"),
             (upstream.url("/status/404"), 400, "HTTP 404"), (upstream.url("/status/503"), 503, "HTTP 503"),
             ("http://127.0.0.1:1/x.png", 503, "All connection attempts failed"),
             (upstream.url("/image.png", "signature=URL-SECRET-0042"), 200, "")]
    for url, status, words in cases:
        reply = http.post("/v1/chat/completions", json=_chat(url))
        if status == 200:
            assert reply.status_code == 200, reply.text
        else:
            _error(reply, status, words)
    assert "URL-SECRET-0042" not in server.log_text()  # a caller's URL is content: never logged


# ---------------------------------------------------------------------------------------------
# HTTP hygiene


def _raw(port: int, data: bytes, *, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes; (what came back, seconds until then)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
    return reply, time.monotonic() - start


def _status(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    error = ErrorResponse.model_validate_json(body).error
    assert error.code == int(head.split()[1]), reply
    return error.code, json.loads(body)


def test_slow_clients_get_408_and_are_closed(server):
    port = server.http_port
    socks = []
    for _ in range(50):  # half-sent heads
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        sock.settimeout(10)
        socks.append(sock)
    start = time.monotonic()
    for sock in socks:
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
        sock.close()
        assert _status(reply)[0] == 408, reply
    assert time.monotonic() - start < HEAD_TIMEOUT_S + 3
    reply, seconds = _raw(port, b"")  # a connection that sends nothing
    assert _status(reply)[0] == 408 and seconds < HEAD_TIMEOUT_S + 2
    stalled = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
               + f"authorization: Bearer {TOKEN}\r\n\r\n".encode() + b"0123456789")
    reply, seconds = _raw(port, stalled)
    code, body = _status(reply)
    assert code == 408 and "did not arrive within 1 s (10 bytes came of 100)" in body["error"]["message"]
    assert seconds < BODY_TIMEOUT_S + 2


def test_bodies_are_admitted_before_they_are_read(http, server):
    """Two bodies in flight at most: while two stalled uploads hold both, a third request waits (in
    the queue) until one of them is given up (408), then is answered."""
    port = server.http_port
    stalled = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
               + f"authorization: Bearer {TOKEN}\r\n\r\n".encode() + b"{")
    holders = [threading.Thread(target=_raw, args=(port, stalled)) for _ in range(2)]
    for thread in holders:
        thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert http.post("/v1/chat/completions", json=_chat(_data_url(PNG))).status_code == 200
    assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - start < BODY_TIMEOUT_S + 5
    for thread in holders:
        thread.join()


def test_malformed_and_oversized_requests_are_openai_errors(http, server):
    port = server.http_port
    reply, _ = _raw(port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"x" * (1 << 20) + b"\r\n\r\n")
    assert _status(reply)[0] == 431  # read whole, then answered: not a reset
    assert _status(_raw(port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"x" * 20_000 + b"\r\n\r\n")[0])[0] == 431
    assert _status(_raw(port, b"\x16\x03\x01 not http at all\r\n\r\n")[0])[0] == 400
    deep = b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    _error(http.post("/v1/chat/completions", content=deep), 400, "nests deeper than 64 levels")
    _error(http.post("/v1/chat/completions", content=b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}"), 400,
           "nests deeper than 64 levels")
    _error(http.get("/v2/nothing"), 404, "no such route: /v2/nothing")
    assert "POST" in _error(http.get("/v1/chat/completions"), 405, "GET is not allowed on /v1/chat/completions")
    assert http.get("/health").status_code == 200 and http.head("/health").status_code == 200
    huge = http.post("/v1/chat/completions", content=b"x" * (65 << 20), headers={"content-type": "application/json"})
    _error(huge, 413, "the limit is")


def test_made_up_methods_do_not_grow_the_metrics(server):
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(timeout=30) as client:
        for method in ("PROPFIND", "BREW", "X" * 20):  # every label this test can make, made once
            client.request(method, f"{base}/health")
            client.request(method, f"{base}/no/such/path")
        before = _metrics(server)
        rng = random.Random(7)
        for i in range(300):
            method = "".join(rng.choices(string.ascii_uppercase, k=8))
            assert client.request(method, f"{base}/health" if i % 2 else f"{base}/x{i}").status_code in (404, 405)
        after = _metrics(server)
    series = [sorted(line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("http_request"))
              for text in (before, after)]
    assert series[0] == series[1]
    assert abs(len(after) - len(before)) < 0.01 * len(before)


# ---------------------------------------------------------------------------------------------
# Sampling and auth


def test_no_sampling_value_gives_a_5xx_on_any_face(http, rpc):
    greedy = http.post("/v1/chat/completions", json=_chat(text="Say hi.", max_tokens=4)).json()
    tiny = http.post("/v1/chat/completions", json=_chat(text="Say hi.", max_tokens=4, temperature=1e-40)).json()
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]  # below 1e-5: greedy, as vLLM
    for extra in ({"temperature": 1.0, "top_p": 5e-324}, {"temperature": 2.0}, {"top_k": 2**31 - 1},
                  {"temperature": 1.0, "seed": 2**64 - 1}):
        assert http.post("/v1/chat/completions", json=_chat(text="Say hi.", **extra)).status_code == 200, extra
    raw = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": %s}'
    for value, words in (("Infinity", "temperature must be a finite number, got inf"),
                         ("NaN", "temperature must be a finite number, got nan"),
                         ("1e39", "temperature must be <= 2, got 1e+39"), ("-1e-40", "temperature must be >= 0")):
        _error(http.post("/v1/chat/completions", content=(raw % value).encode()), 400, words)
    _error(http.post("/v1/chat/completions", content=raw.replace("temperature", "top_p").replace("%s", "-Infinity")
                     .encode()), 400, "top_p must be a finite number, got -inf")
    for sampling in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 5e-324}, {"top_k": 2**31 - 1}):
        events = list(rpc.generate([user("Say hi.")], max_new_tokens=2, sampling=sampling))
        assert events[-1].HasField("finish"), sampling
    for sampling, words in (({"temperature": 1e39}, "temperature must be a finite number, got inf"),  # float32
                            ({"temperature": float("nan")}, "finite"), ({"top_p": float("inf")}, "top_p")):
        with pytest.raises(grpc.RpcError) as info:
            list(rpc.generate([user("Say hi.")], max_new_tokens=2, sampling=sampling))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details(), sampling


def test_a_malformed_protobuf_is_bad_input_with_its_kind(rpc):
    """The protobuf guard refuses as every refusal of the gRPC face does: the status and the kind."""
    with pytest.raises(grpc.RpcError) as info:
        rpc.channel.unary_unary("/kimi.vision.v1.VisionService/Preprocess")(b"\xff\xff\xff\xff\x0f\x08", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid protobuf message of its type (6 bytes)" in info.value.details()
    assert (KIND_METADATA, "bad_input") in info.value.trailing_metadata()


def test_auth_is_in_the_taxonomy_on_every_face(server, tmp_path):
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, timeout=60) as anonymous:
        right = ("authorization", f"Bearer {TOKEN}")
        for headers, words in (([], "missing bearer token"),
                               ([("authorization", "Bearer wrong-token-0123456789")], "invalid bearer token"),
                               ([("authorization", f"Basic {TOKEN}")], "malformed authorization header"),
                               ([right, right], "the authorization header was sent 2 times"),
                               ([("x-request-id", "refused-http-1")], "missing")):
            reply = anonymous.get("/v1/models", headers=headers)
            _error(reply, 401, words)
            assert reply.headers["www-authenticate"].startswith("Bearer")
            assert ErrorResponse.model_validate(reply.json()).error.type == "authentication_error"
        assert anonymous.get("/health").status_code == 200  # health needs no token
        for path in ("/v1/completions", "/tokenize", "/detokenize"):  # every route that works for a caller
            _error(anonymous.post(path, json={"prompt": "x"}), 401, "missing bearer token")
        assert anonymous.get("/version").status_code == 200
        assert anonymous.get("/metrics").status_code == 200  # as on the metrics port: for the scraper
    with VisionClient(server.target, timeout=30) as plain, pytest.raises(grpc.RpcError) as info:
        plain.stub.GetModelInfo(pb.ModelInfoRequest(), metadata=(("x-request-id", "refused-rpc-1"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (KIND_METADATA, "unauthenticated") in info.value.trailing_metadata()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        refusals = {r.get("request_id") for r in _records(server) if "refused" in r["message"]}
        if {"refused-rpc-1", "refused-http-1"} <= refusals:
            break
        time.sleep(0.1)
    assert {"refused-rpc-1", "refused-http-1"} <= refusals  # each face's refusal line carries the caller's id

    line = {"custom_id": "a", "body": _chat(_data_url(PNG))}
    done, rows = _batch(server, tmp_path, [line], env={ENV_VAR: TOKEN})
    assert done.returncode == 0 and rows[0]["response"]["status_code"] == 200, done.stderr
    for args, env in ((["--auth-token", "wrong-token-0123456789"], None), ([], {})):
        start = time.monotonic()
        done, rows = _batch(server, tmp_path, [line] * 3, *args, env=env)
        assert done.returncode == 1 and rows == [], (done.stdout, done.stderr)
        assert "refused" in done.stderr and ("invalid bearer token" in done.stderr or "missing" in done.stderr)
        assert "Traceback" not in done.stderr and time.monotonic() - start < 60
