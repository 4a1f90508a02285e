"""The routes vLLM serves beside chat, against the published shapes: `/v1/completions` read back by
the `openai` SDK's `completions.create` (streamed and not, a list of prompts, token ids, logprobs)
and validated by vLLM 0.33.0's own response models (from its sdist, `peers.vllm_models`);
`/tokenize` and `/detokenize` likewise (their ids against the checkpoint's tokenizer as
`transformers` loads it); `/version`; `/metrics` on the HTTP port with vLLM's series; the sampling
extras vLLM takes (min_p, include_stop_str_in_output, spaces_between_special_tokens,
continuous_usage_stats) on both generating routes; and every refusal an OpenAI error object.

A real server on 127.0.0.1 (HTTP, gRPC and the metrics port) whose trunk writes a fixed chain of
tokens after <|sep|> (`chain_model`), so a completion whose prompt ends in <|sep|> is known:
"Hey, cat.", a stray <|media_pad|>, "!", <|end_of_msg|>.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import peers
import pytest
from chain_model import chain_model
from images import png
from openai_schema import ChatCompletionChunk, ErrorResponse

from service.engine import Engine, EngineConfig
from service.rpc.client import VisionClient, user
from service.server import ServerConfig, ServerThread
from textcore.tokenizer import END_OF_MSG_ID, MEDIA_PAD_ID, SEP_ID

pytestmark = pytest.mark.timeout(300)
TEXT = "Hey, cat."
CHAIN = [*TEXT.encode(), MEDIA_PAD_ID, ord("!"), END_OF_MSG_ID]  # the tiny vocabulary: byte b is token b
REPLY = TEXT + "!"  # the stray special is not text (skip_special_tokens, the default)
TOKENS = len(CHAIN) - 1  # <|end_of_msg|> is not counted
REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Say it<|sep|>"  # ends where the chain starts (control-token spellings in a prompt are ids)
PROMPT_IDS = [*b"Say it", SEP_ID]
MAX_MODEL_LEN = 512
MODEL = "kimi-k3-tiny"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    base = EngineConfig(checkpoint=str(tiny_checkpoint), devices="cpu:1", max_model_len=MAX_MODEL_LEN,
                        served_model_names=(MODEL,))
    with ServerThread(ServerConfig(port=0), base) as loaded:
        main = loaded.engine
        engine = Engine(base, main.tokenizer, main.pool, chain_model(tiny_checkpoint, CHAIN))
        handle = ServerThread(ServerConfig(port=0, http_port=0, metrics_port=0), engine=engine).wait_ready()
        yield handle
        handle.stop()
        engine.cpu_executor.shutdown()
        engine.scheduler.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def vllm():
    return peers.vllm_models()


def _complete(http, vllm, **body) -> dict:
    reply = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert reply.status_code == 200, reply.text
    vllm["CompletionResponse"].model_validate(reply.json())
    return reply.json()


def _events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _count(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text, allow_special=True))


def _refused(reply: httpx.Response, status: int, words: str) -> None:
    assert reply.status_code == status, reply.text
    error = ErrorResponse.model_validate(reply.json()).error
    assert re.search(words, error.message), error.message
    assert error.code == status


def test_the_sdk_reads_a_completion_streamed_and_not(server, sdk, http, vllm):
    done = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    (choice,) = done.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, REPLY, "stop", None)
    assert done.usage.completion_tokens == TOKENS and done.usage.prompt_tokens == _count(server, PROMPT)
    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    for event in _events(http, "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}):
        vllm["CompletionStreamResponse"].model_validate(event)


def test_the_default_max_tokens_is_vllms_16(server, http, vllm):
    body = _complete(http, vllm, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    assert _complete(http, vllm, ignore_eos=True, max_tokens=None)["usage"]["completion_tokens"] == (
        MAX_MODEL_LEN - _count(server, PROMPT))  # null: all the room the model length leaves


def test_prompts_as_strings_token_ids_and_lists_of_them(server, sdk, http, vllm):
    many = sdk.completions.create(model=MODEL, prompt=[PROMPT, "Again<|sep|>"], n=2, max_tokens=20)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [REPLY] * 4
    assert many.usage.prompt_tokens == _count(server, PROMPT) + _count(server, "Again<|sep|>")
    assert many.usage.completion_tokens == 4 * TOKENS
    ids = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=20)
    assert ids.choices[0].text == REPLY and ids.usage.prompt_tokens == len(PROMPT_IDS)
    lists = sdk.completions.create(model=MODEL, prompt=[PROMPT_IDS, [ord("x"), SEP_ID]], max_tokens=20)
    assert [c.text for c in lists.choices] == [REPLY] * 2
    streamed: dict[int, str] = {}
    for event in _events(http, "/v1/completions", {"prompt": [PROMPT, "Again<|sep|>"], "n": 2, "max_tokens": 20}):
        vllm["CompletionStreamResponse"].model_validate(event)
        (choice,) = event["choices"]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == dict.fromkeys(range(4), REPLY)


def test_logprobs_in_openais_completions_shape(sdk, http, vllm):
    done = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert logprobs.tokens == ["H", "e", "y"] and logprobs.text_offset == [0, 1, 2]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob < 0 and top[token] == logprob  # the chosen token, then the most likely ones
        assert 2 <= len(top) <= 3 and max(top.values()) == logprob
    _complete(http, vllm, max_tokens=3, logprobs=2)
    zero = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=0).choices[0].logprobs
    assert [list(top) for top in zero.top_logprobs] == [["H"], ["e"]]
    events = _events(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1})
    streamed = [token for e in events for token in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == ["H", "e", "y"]
    offsets = [o for e in events for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert offsets == [0, 1, 2]


def test_echo_puts_the_prompt_before_the_text(sdk, http):
    """The prompt as given (text), or its ids' text; the generated text follows."""
    assert sdk.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=20).choices[0].text == (
        PROMPT + REPLY)
    events = _events(http, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "max_tokens": 20})
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT + REPLY


def test_the_sampling_extras_vllm_takes(http, vllm):
    stop = _complete(http, vllm, stop="y,", include_stop_str_in_output=True, max_tokens=20)["choices"][0]
    assert (stop["text"], stop["finish_reason"], stop["stop_reason"]) == ("Hey,", "stop", "y,")
    token = _complete(http, vllm, stop_token_ids=[ord(",")], max_tokens=20)["choices"][0]
    assert (token["text"], token["stop_reason"]) == ("Hey", ord(","))
    assert _complete(http, vllm, max_tokens=20)["choices"][0]["stop_reason"] is None  # <|end_of_msg|>
    streamed = _events(http, "/v1/completions", {"prompt": PROMPT, "stop": "y,", "max_tokens": 20})
    assert [c["stop_reason"] for e in streamed for c in e["choices"]][-1] == "y,"

    assert _complete(http, vllm, stop="y,", max_tokens=20)["choices"][0]["text"] == "He"
    spaced = _complete(http, vllm, skip_special_tokens=False, max_tokens=20)["choices"][0]["text"]
    assert spaced == TEXT + " <|media_pad|> !"  # vLLM's default spaces_between_special_tokens
    tight = _complete(http, vllm, skip_special_tokens=False, spaces_between_special_tokens=False, max_tokens=20)
    assert tight["choices"][0]["text"] == TEXT + "<|media_pad|>!"
    # min_p: every token but the chain's next has probability e^-1 of it at temperature 1, under 0.5 of it
    kept = {_complete(http, vllm, temperature=1.0, min_p=0.5, seed=s, max_tokens=20)["choices"][0]["text"]
            for s in range(3)}
    assert kept == {REPLY}
    free = {_complete(http, vllm, temperature=1.0, seed=s, max_tokens=20)["choices"][0]["text"] for s in range(3)}
    assert free != {REPLY}
    # allowed_token_ids: greedy among "a" and "b" (the chain's tokens all masked; <|end_of_msg|> too)
    allowed = _complete(http, vllm, allowed_token_ids=[ord("a"), ord("b")], max_tokens=6)["choices"][0]
    assert len(allowed["text"]) == 6 and set(allowed["text"]) <= {"a", "b"} and allowed["finish_reason"] == "length"
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say it."}],
                                                    "chat_template_kwargs": {"thinking": False}, "min_p": 0.5,
                                                    "temperature": 1.0, "stop": "y,",
                                                    "include_stop_str_in_output": True})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "Hey,"


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server, http, vllm):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "stream_options": options})
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == TOKENS and counts[0] >= 1
    assert all(e["usage"]["prompt_tokens"] == _count(server, PROMPT) for e in events)
    for event in events:
        vllm["CompletionStreamResponse"].model_validate(event)
    chat = _events(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say it."}],
                                                  "chat_template_kwargs": {"thinking": False},
                                                  "stream_options": options})
    assert all(ChatCompletionChunk.model_validate(e).usage is not None for e in chat)
    counts = [e["usage"]["completion_tokens"] for e in chat]
    assert counts == sorted(counts) and counts[-1] == TOKENS
    plain = _events(http, "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}})
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"prompt": PROMPT, "suffix": "x"}, 400, "suffix is not supported"),
    ({"prompt": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, 400,
     "Images are a chat feature"),
    ({"prompt": "look: <|media_pad|>"}, 400, "images are a chat feature"),
    ({"prompt": [1, MEDIA_PAD_ID]}, 400, "images are a chat feature"),
    ({"prompt": [1, 10**6]}, 400, r"prompt\[1\] is 1000000, not a token id of this vocabulary"),
    ({"prompt": [[1], [1, 10**6]]}, 400, r"prompt\[1\]\[1\] is 1000000"),
    ({"prompt": ["a", [1]]}, 400, "prompt must hold strings or lists of token ids, not both"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": [ord("x")] * MAX_MODEL_LEN, "max_tokens": None}, 400,
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ({"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, 400, "'max_tokens' or 'max_completion_tokens' is too large"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist here"),
    ({"prompt": PROMPT, "n": 500}, 400, "above this server's --max-num-seqs"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True, "bogus_key": 1}, "stream": True}, 400,
     r"stream_options has unknown field\(s\) \['bogus_key'\]"),
    ({"prompt": PROMPT, "prompt_logprobs": 1}, 400, r"unsupported parameter\(s\) \['prompt_logprobs'\]"),
    ({"prompt": PROMPT, "min_p": -1}, 400, r"min_p must be in \[0, 1\]"),
    ({"prompt": PROMPT, "allowed_token_ids": [160000]}, 400, "allowed_token_ids names no token this model's"),
    ({"prompt": PROMPT, "allowed_token_ids": [10**6]}, 400, "allowed_token_ids names token 1000000, outside"),
    ([1, 2], 400, "the request body must be a JSON object"),
])
def test_every_refusal_is_an_openai_error(http, body, status, words):
    _refused(http.post("/v1/completions", json=body), status, words)


def _idle(engine: Engine) -> None:
    deadline = time.monotonic() + 30
    while not engine.scheduler.idle:
        assert time.monotonic() < deadline, "the trunk is still at work"
        time.sleep(0.05)


def _sampled(http) -> float:
    """Tokens sampled after another one of their reply, so far (each observes an inter-token latency)."""
    (line,) = [line for line in http.get("/metrics").text.splitlines()
               if line.startswith("vllm:inter_token_latency_seconds_count")]
    return float(line.split(" ")[1])


@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT, "Once more<|sep|>", "Again<|sep|>"]])
def test_a_stream_whose_client_leaves_stops_the_generation(server, http, prompt):
    """Each of its prompts' generations, one or several: the trunk samples a fraction of what it
    was asked for."""
    engine, before, asked = server.engine, _sampled(http), 400
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, "ignore_eos": True,
                                                      "max_tokens": asked, "n": 2}) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())
        assert not engine.scheduler.idle
    _idle(engine)
    replies = 2 * (1 if isinstance(prompt, str) else len(prompt))
    assert _sampled(http) - before < replies * (asked - 1) / 2


def test_tokenize_and_detokenize_as_vllm_and_transformers_read_them(server, http, vllm, tiny_checkpoint):
    """The tokenizer the docs name (`kimi-vision checkpoint-path`) loads with transformers, and its
    ids are the server's."""
    import transformers

    printed = subprocess.run([sys.executable, "-m", "service.cli", "checkpoint-path"], capture_output=True, text=True,
                             check=True, cwd=REPO_ROOT).stdout.strip()
    assert Path(printed) == tiny_checkpoint.resolve()
    hugging_face = transformers.AutoTokenizer.from_pretrained(printed)
    text = "Hello <|open|> wörld 12345"
    reply = http.post("/tokenize", json={"prompt": text, "add_special_tokens": True})
    assert reply.status_code == 200, reply.text
    body = vllm["TokenizeResponse"].model_validate(reply.json())
    assert body.tokens == hugging_face.encode(text) and body.count == len(body.tokens)
    assert body.max_model_len == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"tokens": body.tokens})
    assert vllm["DetokenizeResponse"].model_validate(back.json()).prompt == text == hugging_face.decode(body.tokens)
    _refused(http.post("/detokenize", json={"tokens": [1, 10**6]}), 400, r"tokens\[1\] is 1000000")
    _refused(http.post("/detokenize", json={"tokens": ["1"]}), 400, "tokens must be a list of token ids")
    _refused(http.post("/tokenize", json={"prompt": "x", "messages": []}), 400, "give prompt .* or messages")
    _refused(http.post("/tokenize", json={"prompt": "x", "return_token_strs": True}), 400,
             "return_token_strs=True is not supported")


def test_tokenize_counts_a_chats_images_from_their_headers_as_count_tokens(server, http, vllm):
    data = png(96, 64)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    reply = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"thinking": False}})
    assert reply.status_code == 200, reply.text
    body = vllm["TokenizeResponse"].model_validate(reply.json())
    with VisionClient(server.target, timeout=120) as client:
        counted = client.count_tokens(messages=[user(data, "What is it?")], chat_kwargs={"thinking": False})
    assert body.count == counted.num_tokens and body.tokens.count(MEDIA_PAD_ID) == sum(counted.image_tokens)
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                           "chat_template_kwargs": {"thinking": False}}).json()
    assert without["count"] < body.count  # the generation prompt left out


def test_version_and_metrics_on_the_http_port(server, http):
    assert http.get("/version").json() == {"version": "0.1.0"}
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20})
    _idle(server.engine)  # the reply can come before the scheduler's step that ended it is over
    here = http.get("/metrics")
    assert here.status_code == 200 and here.headers["content-type"].startswith("text/plain")
    there = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics")
    names = {line.split("{")[0].split(" ")[0] for line in here.text.splitlines() if not line.startswith("#")}
    assert names == {line.split("{")[0].split(" ")[0] for line in there.text.splitlines() if not line.startswith("#")}
    labels = f'{{engine="0",model_name="{MODEL}"}}'  # as Prometheus' exposition orders them
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                   "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                   "vllm:e2e_request_latency_seconds_count", "kimi_vision_tokens_total", "http_requests_total"):
        assert series in names, series
    value = {line.split(" ")[0]: float(line.split(" ")[1]) for line in here.text.splitlines()
             if line.startswith("vllm:")}
    assert value[f"vllm:generation_tokens_total{labels}"] >= TOKENS
    assert value[f"vllm:num_requests_running{labels}"] == 0 and value[f"vllm:kv_cache_usage_perc{labels}"] == 0
    assert f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="2560.0",model_name="{MODEL}"}}' in value
    assert f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="7680.0",model_name="{MODEL}"}}' in value
    assert http.head("/metrics").status_code == 200
    filtered = http.get("/metrics", params={"name[]": "vllm:prompt_tokens_total"}).text
    assert "vllm:prompt_tokens_total" in filtered and "http_requests_total" not in filtered
