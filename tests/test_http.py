"""The OpenAI-compatible HTTP face and vLLM's disaggregated encoding, through real `kimi-vision serve`
processes on 127.0.0.1 and a real HTTP client.

- The encoder role of vLLM's EPD: the request vLLM's proxy sends (`max_tokens` 1, `stream` false,
  the image as a `data:` URL) writes the image's encoder-cache file under the hash vLLM itself
  computes (a golden of ../shared/conformance/vllm), holding the Embed RPC's rows.
- Chat completions through the trunk, streamed and not; error bodies and statuses; `/health`
  across warm-up and SIGTERM; the token; vision-only serving from a checkpoint without trunk shards.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from conformance_data import needs_vllm_goldens, vllm_goldens, vllm_image
from openai_schema import ChatCompletion, ChatCompletionChunk, ErrorResponse
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from serve_process import ServeProcess

from service.checkpoints.default import default_checkpoint_dir
from service.rpc.client import VisionClient, user
from textcore.generate import SamplingError, SamplingParams
from vision.checkpoint import INDEX_FILE

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE = REPO_ROOT / "samples" / "photo.jpg"
TOKEN = "http-face-test-token-0123456789"
pytestmark = pytest.mark.timeout(300)


def _data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat(data: bytes, *, text: str = "What is in the image?", **extra) -> dict:
    return {"model": "moonshotai/Kimi-K3", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(data)}}, {"type": "text", "text": text}]}], **extra}


def _proxy_request(original: dict) -> dict:
    """What vLLM's disagg_epd_proxy.py sends the encode instance for a user's request."""
    request = json.loads(json.dumps(original))
    request["max_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def server(tmp_path_factory, export_dir):
    """The embedded default in EC producer mode, one work slot and no queue (so overload is easy to
    provoke), 4 MB messages."""
    log = tmp_path_factory.mktemp("http") / "serve.log"
    args = ["--devices", "cpu:1", "--http-port", "0", "--ec-export-dir", str(export_dir), "--ec-role", "producer",
            "--max-concurrency", "1", "--max-queue", "0", "--max-message-mb", "4"]
    with ServeProcess.start(args, log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def rpc(server):
    with VisionClient(server.target, timeout=120) as client:
        yield client


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(reply: httpx.Response, status: int, words: str) -> None:
    assert reply.status_code == status, reply.text
    body = ErrorResponse.model_validate(reply.json())
    assert body.error.code == status and words in body.error.message, body.error.message
    assert "Traceback" not in reply.text


# ---------------------------------------------------------------------------------------------
# vLLM's disaggregated encoder


@needs_vllm_goldens
def test_the_proxy_request_writes_the_file_vllm_looks_for(http, rpc, export_dir):
    goldens = vllm_goldens()
    case = next(c for c in goldens["cases"] if c["file"] == "rgb_160x120.jpg" and c["algorithm"] == "blake3"
                and c["model_id"] == "moonshotai/Kimi-K3")
    data = vllm_image(case["file"])
    reply = http.post("/v1/chat/completions", json=_proxy_request(_chat(data, stream=True)),
                      headers={"x-request-id": "proxy-req-1"})
    assert reply.status_code == 200, reply.text
    body = ChatCompletion.model_validate(reply.json())
    assert body.usage.completion_tokens == 0 and body.choices[0].finish_reason == "length"  # no trunk ran
    counted = rpc.count_tokens(messages=[user("What is in the image?", data)]).num_tokens
    assert body.usage.prompt_tokens == counted  # after media_pad expansion
    path = export_dir / case["mm_hash"] / "encoder_cache.safetensors"
    assert path.is_file(), sorted(p.name for p in export_dir.iterdir())
    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["ec_cache"]
    written = load_file(str(path))["ec_cache"]
    header, rows = rpc.embed(data, dtype="bfloat16")
    assert str(written.dtype) == "torch.bfloat16" and list(written.shape) == list(header.shape)
    np.testing.assert_array_equal(written.float().numpy(), rows)


def test_a_client_uuid_names_the_file(http, export_dir):
    data = SAMPLE.read_bytes()
    part = {"type": "image_url", "image_url": {"url": _data_url(data)}, "uuid": "user-item-42"}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert (export_dir / "user-item-42" / "encoder_cache.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# Chat completions through the trunk


def test_chat_completions_streamed_and_not(http, rpc):
    data = SAMPLE.read_bytes()
    request = _chat(data, max_tokens=6)
    whole = ChatCompletion.model_validate(http.post("/v1/chat/completions", json=request).json())
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens == rpc.count_tokens(messages=[user("What is in the image?", data)]).num_tokens
    message = whole.choices[0].message.model_dump()
    assert set(message) >= {"role", "content", "reasoning"}  # reasoning text where vLLM puts it

    chunks = []
    with http.stream("POST", "/v1/chat/completions",
                     json={**request, "stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                chunks.append(line.removeprefix("data: "))
    assert chunks[-1] == "[DONE]"
    parsed = [ChatCompletionChunk.model_validate_json(c) for c in chunks[:-1]]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[-1].choices == [] and parsed[-1].usage == whole.usage
    assert parsed[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    reasoning = "".join(c.choices[0].delta.reasoning or "" for c in parsed if c.choices)
    assert (text, reasoning) == (message["content"], message["reasoning"] or "")  # greedy: the same reply

    seeded = {**request, "temperature": 0.9, "top_p": 0.9, "seed": 11}
    first, again = (http.post("/v1/chat/completions", json=seeded).json() for _ in range(2))
    assert first["choices"][0]["message"] == again["choices"][0]["message"]  # same seed, same text


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["moonshotai/Kimi-K3"]
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------
# Errors: each status from a real request


def test_error_bodies_and_statuses(http, server):
    data = SAMPLE.read_bytes()
    _error(http.post("/v1/chat/completions", json=_chat(b"not an image at all")), 400, "bad image")
    _error(http.post("/v1/chat/completions", json=_chat(data, best_of=2)), 400, "best_of")
    _error(http.post("/v1/chat/completions", json={**_chat(data), "model": "gpt-4o"}), 404, "gpt-4o")
    _error(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400, "not valid JSON")
    remote = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]}
    _error(http.post("/v1/chat/completions", json=remote), 400, "--allow-remote-images")
    huge = _chat(os.urandom(5 << 20))  # over the 4 MB message limit (~6.7 MB of base64)
    _error(http.post("/v1/chat/completions", json=huge), 413, "limit")

    # One work slot, no queue: while a long stream holds the slot, another request is 429.
    long = _chat(data, max_tokens=400, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=long) as held:
        lines = held.iter_lines()
        assert next(lines).startswith("data: ")  # the slot is held now
        _error(http.post("/v1/chat/completions", json=_chat(data, max_tokens=2)), 429, "capacity")
    deadline = time.monotonic() + 30  # the abandoned stream gives its slot back
    while http.post("/v1/chat/completions", json=_chat(data, max_tokens=1)).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)


@pytest.mark.parametrize(("sampling", "message"), [({"top_p": 5}, "top_p must be in (0, 1], got 5.0"),
                                                  ({"temperature": -1}, "temperature must be >= 0, got -1.0")])
def test_every_face_reports_a_bad_sampling_value_alike(http, rpc, server, tmp_path, sampling, message):
    """SamplingParams is the one place the ranges are checked: the HTTP face (400, the OpenAI error
    object), the gRPC face (INVALID_ARGUMENT) and a batch job (an error row, bad_input) give its
    message, word for word."""
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{key: float(value) for key, value in sampling.items()})  # each face reads a float
    assert str(caught.value) == message
    request = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **sampling}

    reply = http.post("/v1/chat/completions", json=request)
    assert reply.status_code == 400, reply.text
    error = ErrorResponse.model_validate(reply.json()).error
    assert (error.message, error.type, error.code) == (message, "invalid_request_error", 400)

    with pytest.raises(grpc.RpcError) as info:
        list(rpc.generate([user("Say hi.")], max_new_tokens=2, sampling=sampling))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)

    lines, output = tmp_path / "lines.jsonl", tmp_path / "out.jsonl"
    lines.write_text(json.dumps({"custom_id": "bad", "body": request}) + "\n")
    done = subprocess.run([sys.executable, "-m", "service.cli", "batch", "--task", "caption", "--input", str(lines),
                           "--output", str(output), "--server", server.target], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240)
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["response"]["status_code"] == 400, (done.stderr, row)
    assert (row["error"]["code"], row["error"]["message"]) == ("bad_input", f"line 1: {message}")


# ---------------------------------------------------------------------------------------------
# Health across warm-up and SIGTERM; the token


def test_health_follows_warm_up_and_drain_and_the_token_guards_the_api(tmp_path):
    port = _free_port()
    statuses: list[int] = []
    proc = ServeProcess.launch(["--devices", "cpu:1", "--http-port", str(port), "--drain-seconds", "30"],
                               log_path=tmp_path / "serve.log", env={"KIMI_VISION_AUTH_TOKEN": TOKEN})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:  # connection refused until the port is bound; 503 while the model warms up
                assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log_text()[-2000:]
                try:
                    status = client.get("/health").status_code
                except httpx.ConnectError:
                    time.sleep(0.02)
                    continue
                if status == 200:
                    break
                statuses.append(status)
                time.sleep(0.02)
            proc.wait_ready(120)
            assert statuses and set(statuses) == {503}, statuses
            _error(client.get("/v1/models"), 401, "missing bearer token")
            _error(client.get("/v1/models", headers={"authorization": "Bearer wrong-token-0123456789"}), 401,
                   "invalid bearer token")
            auth = {"authorization": f"Bearer {TOKEN}"}
            assert client.get("/v1/models", headers=auth).status_code == 200

            # SIGTERM with a stream in flight: health 503 and new requests 503; the stream finishes.
            request = _chat(SAMPLE.read_bytes(), max_tokens=40, stream=True)
            done: list[str] = []
            with client.stream("POST", "/v1/chat/completions", json=request, headers=auth) as stream:
                lines = stream.iter_lines()
                next(lines)
                proc.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 20
                while client.get("/health").status_code != 503:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                _error(client.post("/v1/chat/completions", json=_chat(SAMPLE.read_bytes()), headers=auth), 503,
                       "draining")
                done = [line for line in lines if line.startswith("data: ")]
            assert done[-1] == "data: [DONE]"
        assert proc.proc.wait(60) == 0
    finally:
        proc.kill()


# ---------------------------------------------------------------------------------------------
# Vision-only serving


def _without_trunk_shards(src: Path, dst: Path) -> Path:
    """The default checkpoint re-sharded (vision tensors in one shard, the trunk's in another), with
    the trunk's shard then deleted: what a vision frontend keeps of the published layout."""
    dst.mkdir()
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    groups = {"model-vision.safetensors": {n: t for n, t in tensors.items() if not n.startswith("language_model.")},
              "model-trunk.safetensors": {n: t for n, t in tensors.items() if n.startswith("language_model.")}}
    weight_map = {}
    for name, group in groups.items():
        save_file(group, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for item in src.iterdir():
        if not item.name.endswith(".safetensors") and item.name != INDEX_FILE:
            shutil.copy(item, dst / item.name)
    (dst / "model-trunk.safetensors").unlink()
    return dst


def test_vision_only_serving_reads_no_trunk_tensor(server, tmp_path):
    checkpoint = _without_trunk_shards(default_checkpoint_dir(), tmp_path / "vision-only")
    args = ["--checkpoint", str(checkpoint), "--components", "vision", "--devices", "cpu:1", "--http-port", "0",
            "--ec-export-dir", str(tmp_path / "ec"), "--ec-role", "producer"]
    data = SAMPLE.read_bytes()
    with ServeProcess.start(args, log_path=tmp_path / "serve.log") as vision_only, \
            VisionClient(vision_only.target, timeout=120) as client:
        assert client.preprocess(data).num_tokens == 414
        assert client.count_tokens(messages=[user("What is this?", data)]).num_tokens > 414
        header, rows = client.embed(data)
        assert rows.shape == (414, header.hidden_size)
        assert client.encode([user("What is this?", data)]).embeddings.shape == rows.shape
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate([user("What is this?", data)], max_new_tokens=3))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "components=vision" in info.value.details()
        with httpx.Client(base_url=f"http://127.0.0.1:{vision_only.http_port}", timeout=120) as http:
            assert http.post("/v1/chat/completions", json=_chat(data, max_tokens=1)).status_code == 200
            _error(http.post("/v1/chat/completions", json=_chat(data, max_tokens=5)), 400, "components=vision")
        assert client.model_info().components == "vision"
        vision_rss, full_rss = vision_only.rss(), server.rss()
    print(f"\nresident memory of the server process, idle after warm-up: components=all {full_rss / 2**20:.0f} MiB, "
          f"components=vision {vision_rss / 2**20:.0f} MiB")
    assert vision_rss < full_rss

