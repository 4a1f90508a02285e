"""The OpenAI-compatible HTTP face and vLLM's disaggregated encoding, through real `kimi-vision serve`
processes on 127.0.0.1 and a real HTTP client.

- The encoder role of vLLM's EPD: vLLM 0.33.0's own proxy, run as a script (taken from its sdist
  at test time, `peers.vllm_epd_proxy`; skipped offline), in front of the producer: the decode
  request it sends holds `image_embeds` references whose files hold the Embed RPC's rows. The request vLLM's first proxy
  sent (`max_tokens` 1, the whole chat) writes the file under the hash vLLM itself computes (a
  golden of ../shared/conformance/vllm). Every vLLM 0.33.0 chat parameter is taken, with or
  without `max_tokens`, answered with no completion tokens; `stream: true` is SSE the OpenAI SDK reads.
- Chat completions through the trunk, streamed and not; error bodies and statuses; `/health`
  across warm-up and SIGTERM; the token; vision-only serving from a checkpoint without trunk shards.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import openai
import peers
import pytest
from conformance_data import needs_vllm_goldens, vllm_goldens, vllm_image
from openai_schema import ChatCompletion, ChatCompletionChunk, EncoderCompletion, ErrorResponse
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from serve_process import ServeProcess, free_port
from vllm_decoder import Decoder

from service.checkpoints.default import default_checkpoint_dir
from service.engine import EngineConfig
from service.openai.request import VLLM_CHAT_PARAMETERS
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import VisionClient, user
from service.server import ServerConfig, ServerThread
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
    """What vLLM's first EPD proxy (examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py)
    sent the encode instance for a user's request: the whole request, capped at one token."""
    request = json.loads(json.dumps(original))
    request["max_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


@pytest.fixture(scope="session")
def vllm_proxy() -> Path:
    """vLLM 0.33.0's examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py, from its sdist."""
    return peers.vllm_epd_proxy()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded default, one work slot and no queue (so overload is easy to provoke), 4 MB messages."""
    log = tmp_path_factory.mktemp("http") / "serve.log"
    args = ["--devices", "cpu:1", "--http-port", "0", "--max-concurrency", "1", "--max-queue", "0",
            "--max-message-mb", "4"]
    with ServeProcess.start(args, log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as client:
        yield client



@pytest.fixture(scope="module")
def producer(tmp_path_factory, export_dir):
    """The embedded default as vLLM's encoder (EC producer mode): the process, an HTTP and a gRPC client."""
    log = tmp_path_factory.mktemp("producer") / "serve.log"
    args = ["--devices", "cpu:1", "--http-port", "0", "--ec-export-dir", str(export_dir), "--ec-role", "producer",
            "--metrics-port", "0"]
    with (ServeProcess.start(args, log_path=log) as proc,
          httpx.Client(base_url=f"http://127.0.0.1:{proc.http_port}", timeout=120) as http,
          VisionClient(proc.target, timeout=120) as rpc_client):
        yield SimpleNamespace(proc=proc, http=http, rpc=rpc_client)


def _error(reply: httpx.Response, status: int, words: str) -> None:
    assert reply.status_code == status, reply.text
    body = ErrorResponse.model_validate(reply.json())
    assert body.error.code == status and words in body.error.message, body.error.message
    assert "Traceback" not in reply.text


# ---------------------------------------------------------------------------------------------
# vLLM's disaggregated encoder


@needs_vllm_goldens
def test_the_first_proxys_request_writes_the_file_vllm_looks_for(producer, export_dir):
    goldens = vllm_goldens()
    case = next(c for c in goldens["cases"] if c["file"] == "rgb_160x120.jpg" and c["algorithm"] == "blake3"
                and c["model_id"] == "moonshotai/Kimi-K3")
    data = vllm_image(case["file"])
    reply = producer.http.post("/v1/chat/completions", json=_proxy_request(_chat(data, stream=True)),
                               headers={"x-request-id": "proxy-req-1"})
    assert reply.status_code == 200, reply.text
    body = EncoderCompletion.model_validate(reply.json())
    assert body.usage.completion_tokens == 0 and body.choices[0].finish_reason == "length"  # no trunk ran
    assert list(body.ec_transfer_params) == [case["mm_hash"]]
    counted = producer.rpc.count_tokens(messages=[user("What is in the image?", data)]).num_tokens
    assert body.usage.prompt_tokens == counted  # after media_pad expansion
    path = export_dir / case["mm_hash"] / "encoder_cache.safetensors"
    assert path.is_file(), sorted(p.name for p in export_dir.iterdir())
    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["ec_cache"]
    written = load_file(str(path))["ec_cache"]
    header, rows = producer.rpc.embed(data, dtype="bfloat16")
    assert str(written.dtype) == "torch.bfloat16" and list(written.shape) == list(header.shape)
    np.testing.assert_array_equal(written.float().numpy(), rows)


def test_a_client_uuid_names_the_file(producer, export_dir):
    data = SAMPLE.read_bytes()
    part = {"type": "image_url", "image_url": {"url": _data_url(data)}, "uuid": "user-item-42"}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    assert producer.http.post("/v1/chat/completions", json=body).status_code == 200
    assert (export_dir / "user-item-42" / "encoder_cache.safetensors").is_file()


def _embeds_so_far(producer) -> float:
    """The engine's embedding-cache lookups: one per item of every encode that ran."""
    text = httpx.get(f"http://127.0.0.1:{producer.proc.metrics_port}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^kimi_vision_embed_cache_lookups_total\{[^}]*\} (\S+)$", text, re.M))


def _post_image(producer, data: bytes, uuid: object = None, mime: str = "image/jpeg", url: str | None = None):
    part = {"type": "image_url", "image_url": {"url": url or _data_url(data, mime)}}
    if uuid is not None:
        part["uuid"] = uuid
    return producer.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})


BAD_UUIDS = ["../x", "a/b", "a\x00b", "x" * 10_240, "okname\n", ""]
UUID_RULE_WORDS = "uuid must be 1 to 128 characters, each a letter"


def test_an_invalid_uuid_is_a_400_naming_the_rule_before_any_work(producer, export_dir):
    """Each is refused before its image is read (a URL this server would refuse to fetch is never
    reached) or encoded (no embedding lookup), and no file or directory is made, on both faces."""
    data = SAMPLE.read_bytes()
    before, entries = _embeds_so_far(producer), sorted(os.listdir(export_dir))
    for bad in [*BAD_UUIDS, 7, ["a"]]:
        for url in (None, "http://127.0.0.1:9/never-fetched.png"):
            _error(_post_image(producer, data, bad, url=url), 400, UUID_RULE_WORDS)
    for bad in BAD_UUIDS[:-1]:  # (proto3: an empty uuid is no uuid)
        with pytest.raises(grpc.RpcError) as info:
            producer.rpc.encode([user("x", pb.Image(data=data, uuid=bad))], export_vllm_ec=True)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and UUID_RULE_WORDS in info.value.details()
    assert _embeds_so_far(producer) == before and sorted(os.listdir(export_dir)) == entries
    assert not any(export_dir.parent.glob("**/okname*")) and "Traceback" not in producer.proc.log_text()


def test_an_entry_is_never_replaced_nor_taken_by_another_image(producer, export_dir):
    """First writer wins: the same image again gets its key, another image under a named uuid a
    400, the first file left bit for bit. A uuid shaped like a content hash must be the item's own
    (its mm_hash, or the sha256 of its URL): another image's key, written or not, is a 400 before
    any encoding, on both faces."""
    first, second = SAMPLE.read_bytes(), (REPO_ROOT / "samples" / "sticker_rgba.png").read_bytes()
    assert _post_image(producer, first, "first-come-7").status_code == 200
    path = export_dir / "first-come-7" / "encoder_cache.safetensors"
    kept = path.read_bytes()
    _error(_post_image(producer, second, "first-come-7", "image/png"), 400, "already holds another image's embeddings")
    again = _post_image(producer, first, "first-come-7")
    assert again.status_code == 200 and list(again.json()["ec_transfer_params"]) == ["first-come-7"]
    assert path.read_bytes() == kept

    (key,) = _post_image(producer, first).json()["ec_transfer_params"]  # vLLM's own mm_hash of `first`
    mm_file = export_dir / key / "encoder_cache.safetensors"
    kept_mm = mm_file.read_bytes()
    before, entries = _embeds_so_far(producer), sorted(os.listdir(export_dir))
    proxy_key = hashlib.sha256(_data_url(first).encode()).hexdigest()  # vLLM's proxy's key for `first`
    for foreign in (key, proxy_key, "ab" * 32, "cd" * 64, key.upper()):
        _error(_post_image(producer, second, foreign, "image/png"), 400, "has the form of a content hash")
        with pytest.raises(grpc.RpcError) as info:
            producer.rpc.encode([user("x", pb.Image(data=second, uuid=foreign))], export_vllm_ec=True)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "content hash" in info.value.details()
    assert _embeds_so_far(producer) == before and sorted(os.listdir(export_dir)) == entries
    assert mm_file.read_bytes() == kept_mm and path.read_bytes() == kept
    # The item's own keys are taken, as vLLM's proxy and a client repeating vLLM's hash send them.
    for own in (key, proxy_key):
        reply = _post_image(producer, first, own)
        assert reply.status_code == 200 and list(reply.json()["ec_transfer_params"]) == [own]
    assert mm_file.read_bytes() == kept_mm


def test_racing_writers_of_one_uuid_leave_one_complete_file(producer, export_dir):
    """Requests racing for one uuid with two images: those with the winner's image get the key,
    the others a 400; the file holds the winner's rows, whole."""
    images = [SAMPLE.read_bytes(), (REPO_ROOT / "samples" / "sticker_rgba.png").read_bytes()] * 3
    mimes = ["image/jpeg", "image/png"] * 3
    with ThreadPoolExecutor(len(images)) as pool:
        replies = list(pool.map(lambda i: _post_image(producer, images[i], "raced-uuid", mimes[i]),
                                range(len(images))))
    statuses = [r.status_code for r in replies]
    winner = statuses.index(200)
    assert all((s == 200) == (images[i] == images[winner]) for i, s in enumerate(statuses)), statuses
    for reply in replies:
        if reply.status_code != 200:
            _error(reply, 400, "already holds another image's embeddings")
    key_dir = export_dir / "raced-uuid"
    assert os.listdir(key_dir) == ["encoder_cache.safetensors"]
    written = load_file(str(key_dir / "encoder_cache.safetensors"))["ec_cache"]
    _, rows = producer.rpc.embed(images[winner], dtype="bfloat16")
    np.testing.assert_array_equal(written.float().numpy(), rows)


# Every field of vLLM 0.33.0's ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py),
# each set to a value a vLLM client may send (stream_options only empty without stream, as vLLM
# refuses); an encoder samples nothing, so it takes them all.
EVERY_VLLM_PARAMETER = {
    "model": "moonshotai/Kimi-K3", "frequency_penalty": 0.5, "logit_bias": {"100": 2.0}, "logprobs": True,
    "top_logprobs": 3, "max_tokens": 512, "max_completion_tokens": 64, "n": 2, "presence_penalty": 0.3,
    "response_format": {"type": "text"}, "seed": 7, "stop": ["\n\n"], "stream": False,
    "stream_options": {}, "temperature": 0.7, "top_p": 0.9,
    "tools": [{"type": "function", "function": {"name": "look", "description": "Look closer.",
                                                "parameters": {"type": "object", "properties": {}}}}],
    "tool_choice": "auto", "reasoning_effort": "low", "thinking_token_budget": 128, "include_reasoning": False,
    "parallel_tool_calls": False, "user": "tester", "use_beam_search": False, "top_k": 20, "min_p": 0.05,
    "repetition_penalty": 1.1, "watermarking": False, "length_penalty": 1.0, "stop_token_ids": [163586],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 4, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": -1, "truncation_side": "left",
    "prompt_logprobs": 2, "logprob_token_ids": [1, 2], "allowed_token_ids": [1, 2, 3], "bad_words": ["never"],
    "echo": False, "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
    "documents": [{"title": "note", "text": "a note"}], "chat_template": None,
    "chat_template_kwargs": {"thinking": False}, "media_io_kwargs": None, "mm_processor_kwargs": {},
    "structured_outputs": {"json": {"type": "object"}}, "priority": 5, "request_id": "every-parameter",
    "session_id": "session-1", "return_tokens_as_token_ids": True, "return_token_ids": True,
    "return_weight_versions": False, "routed_experts_prompt_start": 0, "return_token_offsets": False,
    "return_prompt_text": False, "mm_payload": "none", "return_mm_kwargs": False, "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": False}, "ec_transfer_params": {}, "vllm_xargs": {"knob": 1},
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "stream_interval": 2,
}


def test_every_vllm_chat_parameter_is_taken_with_or_without_max_tokens(producer):
    """vLLM 0.33.0's chat parameters, all of them (the list the producer takes is that release's):
    answered at once, no completion tokens, with the image's key and grid in `ec_transfer_params`."""
    assert set(EVERY_VLLM_PARAMETER) | {"messages"} == set(VLLM_CHAT_PARAMETERS)
    data = SAMPLE.read_bytes()
    grid = list(producer.rpc.preprocess(data).grid_thw)
    for body in (EVERY_VLLM_PARAMETER, {k: v for k, v in EVERY_VLLM_PARAMETER.items()
                                        if k not in ("max_tokens", "max_completion_tokens")}):
        reply = producer.http.post("/v1/chat/completions", json=_chat(data, **body))
        assert reply.status_code == 200, reply.text
        answer = EncoderCompletion.model_validate(reply.json())
        assert answer.usage.completion_tokens == 0 and answer.choices[0].message.content == ""
        (key, entry), = answer.ec_transfer_params.items()
        assert entry == {"modality": "image", "item_indices": [0], "metadata": {"grid_thws": grid}}


def test_a_producer_refuses_what_vllm_does_not_take_or_it_cannot_follow(producer):
    data = SAMPLE.read_bytes()
    for extra, words in (({"best_of": 2}, "best_of"), ({"mm_processor_kwargs": {"max_pixels": 1000}}, "release"),
                         ({"media_io_kwargs": {"image": {"mode": "RGB"}}}, "media_io_kwargs"),
                         ({"ec_transfer_params": {"consumer_zmq": "tcp://d:1", "ec_items": []}}, "Mooncake")):
        _error(producer.http.post("/v1/chat/completions", json=_chat(data, **extra)), 400, words)


def test_a_producers_stream_is_one_chunk_the_openai_sdk_reads(producer):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{producer.proc.http_port}/v1", api_key="none")
    messages = _chat(SAMPLE.read_bytes())["messages"]
    chunks = list(client.chat.completions.create(model="moonshotai/Kimi-K3", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    (only,) = chunks
    assert only.choices[0].delta.role == "assistant" and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens > 414
    assert "ec_transfer_params" not in (only.model_extra or {})  # as vLLM's streamed chunks: none


def _run_proxy(script: Path, encoder_port: int, decoder_port: int, log: Path,
               encoder_host: str = "127.0.0.1") -> tuple[subprocess.Popen, int]:
    """vLLM's proxy as its example runs it, E + PD (the encoder on `encoder_host`, the rest on
    127.0.0.1); back once its /health says all are up."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port),
                             "--encode-servers-urls", f"http://{encoder_host}:{encoder_port}",
                             "--prefill-servers-urls", "none", "--decode-servers-urls",
                             f"http://127.0.0.1:{decoder_port}"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the proxy did not come up: {log.read_text()[-3000:]}")


def test_behind_vllms_proxy_the_decoder_gets_image_embeds_references(vllm_proxy, producer, export_dir, tmp_path):
    """vLLM 0.33.0's proxy (its own script) with a user's request of two images and a priority: one
    encoder request for both, answered with their keys and grids; the decode request then holds
    `image_embeds` references under the proxy's uuids, whose files hold the Embed RPC's rows."""
    images = [SAMPLE.read_bytes(), (REPO_ROOT / "samples" / "sticker_rgba.png").read_bytes()]
    urls = [_data_url(images[0]), _data_url(images[1], "image/png")]
    decoder = Decoder()
    proc, port = _run_proxy(vllm_proxy, producer.proc.http_port, decoder.server_address[1], tmp_path / "proxy.log")
    try:
        request = {"model": "moonshotai/Kimi-K3", "priority": 5, "session_id": "s-1", "max_tokens": 8,
                   "messages": [{"role": "user", "content": [
                       {"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "and"},
                       {"type": "image_url", "image_url": {"url": urls[1]}}]}]}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=request, timeout=120)
        assert reply.status_code == 200, (reply.text, (tmp_path / "proxy.log").read_text()[-3000:])
        assert reply.json()["choices"][0]["message"]["content"] == "cat"
    finally:
        proc.terminate()
        proc.wait(30)
        decoder.shutdown()
    (decoded,) = decoder.requests
    assert decoded["priority"] == 5 and decoded["max_tokens"] == 8
    references = [part for part in decoded["messages"][0]["content"] if part["type"] != "text"]
    for part, url, data in zip(references, urls, images, strict=True):
        uuid = hashlib.sha256(url.encode()).hexdigest()  # the proxy's content_uuid
        assert part == {"type": "image_embeds", "uuid": uuid,
                        "image_embeds": {"grid_thws": list(producer.rpc.preprocess(data).grid_thw)}}
        written = load_file(str(export_dir / uuid / "encoder_cache.safetensors"))["ec_cache"]
        _, rows = producer.rpc.embed(data, dtype="bfloat16")
        np.testing.assert_array_equal(written.float().numpy(), rows)


def test_vllms_proxy_on_another_address_with_content_keys_only(vllm_proxy, tmp_path):
    """An encoder on 127.0.0.2 taking content keys only (`--ec-client-uuids content`), vLLM's proxy
    and decoder on 127.0.0.1: the proxy's uuids (the sha256 of each URL) are taken, twice (the second
    time the files are there already and kept); a uuid a client names is a 400 there."""
    export = tmp_path / "ec"
    args = ["--host", "127.0.0.2", "--devices", "cpu:1", "--http-port", "0", "--ec-export-dir", str(export),
            "--ec-role", "producer", "--ec-client-uuids", "content"]
    data = SAMPLE.read_bytes()
    url = _data_url(data)
    decoder = Decoder()
    with ServeProcess.start(args, log_path=tmp_path / "serve.log") as encoder:
        assert encoder.host == "127.0.0.2"
        named = httpx.post(f"http://127.0.0.2:{encoder.http_port}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url},
                                                       "uuid": "user-item-42"}]}]})
        _error(named, 400, "--ec-client-uuids content")
        proc, port = _run_proxy(vllm_proxy, encoder.http_port, decoder.server_address[1], tmp_path / "proxy.log",
                                encoder_host="127.0.0.2")
        try:
            request = {"model": "moonshotai/Kimi-K3", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]}]}
            for _ in range(2):
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=request, timeout=120)
                assert reply.status_code == 200, (reply.text, (tmp_path / "proxy.log").read_text()[-3000:])
        finally:
            proc.terminate()
            proc.wait(30)
            decoder.shutdown()
    uuid = hashlib.sha256(url.encode()).hexdigest()
    assert [part["uuid"] for d in decoder.requests for part in d["messages"][0]["content"]
            if part["type"] == "image_embeds"] == [uuid, uuid]
    # (the store's own names start with a dot: its leases; no key does)
    assert [name for name in os.listdir(export) if name[0] != "."] == [uuid] and not (export / "user-item-42").exists()


# ---------------------------------------------------------------------------------------------
# Chat completions through the trunk


def test_chat_completions_streamed_and_not(http, rpc_client):
    data = SAMPLE.read_bytes()
    request = _chat(data, max_tokens=6)
    whole = ChatCompletion.model_validate(http.post("/v1/chat/completions", json=request).json())
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    counted = rpc_client.count_tokens(messages=[user("What is in the image?", data)])
    assert whole.usage.prompt_tokens == counted.num_tokens
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


def test_models_of_a_server_whose_model_failed_to_load(tmp_path):
    """/v1/models gives admission's refusal, as the chat route does: failed to load, not warming up."""
    handle = ServerThread(ServerConfig(port=0, http_port=0), EngineConfig(checkpoint=str(tmp_path / "missing")))
    try:
        with pytest.raises(Exception, match="checkpoint directory not found"):
            handle.wait_ready()
        with httpx.Client(base_url=f"http://127.0.0.1:{handle.server.http_port}", timeout=30) as client:
            _error(client.get("/v1/models"), 503, "server failed to load its model")
            _error(client.post("/v1/chat/completions", json=_chat(SAMPLE.read_bytes())), 503,
                   "server failed to load its model")
    finally:
        handle.stop()


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
def test_every_face_reports_a_bad_sampling_value_alike(http, rpc_client, server, tmp_path, sampling, message):
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
        list(rpc_client.generate([user("Say hi.")], max_new_tokens=2, sampling=sampling))
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
    port = free_port()
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
            for max_tokens in (1, 5, None):  # a producer encodes whatever max_tokens says, and never samples
                reply = http.post("/v1/chat/completions", json=_chat(data, max_tokens=max_tokens))
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 0, reply.text
        assert client.model_info().components == "vision"
        vision_rss, full_rss = vision_only.rss(), server.rss()
    print(f"\nresident memory of the server process, idle after warm-up: components=all {full_rss / 2**20:.0f} MiB, "
          f"components=vision {vision_rss / 2**20:.0f} MiB")
    assert vision_rss < full_rss

