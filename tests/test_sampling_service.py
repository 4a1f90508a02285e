"""The sampling parameters users send, on every face, against OpenAI's documented behaviour: stop
strings (the matched text excluded, one that spans two tokens), stop_token_ids, `n` choices indexed
0..n-1 with the usage of all, logprobs in `choices[].logprobs.content` (validated against the
OpenAI object's shape), min_tokens, ignore_eos, logit_bias, skip_special_tokens; the KV budget;
generations beside admission's work slots; a stream whose client leaves.

A real server on 127.0.0.1 (HTTP and gRPC) whose trunk writes a fixed chain of tokens
(`chain_model`): "Hey, cat.", a stray <|media_pad|>, "!", <|end_of_msg|>, so each reply is known.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from chain_model import chain_model
from openai_schema import ChatCompletion, ChatCompletionChunk, ErrorResponse

from service.engine import Engine, EngineConfig
from service.rpc._proto import vision_pb2 as pb
from service.rpc.client import VisionClient, user
from service.server import ServerConfig, ServerThread
from textcore.model import SequenceCache
from textcore.tokenizer import END_OF_MSG_ID, MEDIA_PAD_ID

pytestmark = pytest.mark.timeout(300)
REPO_ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hey, cat."
CHAIN = [*TEXT.encode(), MEDIA_PAD_ID, ord("!"), END_OF_MSG_ID]  # the tiny vocabulary: byte b is token b
REPLY = TEXT + "!"  # the stray special is not text (skip_special_tokens, the default)
TOKENS = len(CHAIN) - 1  # <|end_of_msg|> is not counted



@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    """A server that loads the tokenizer and the encoder pool the writers share."""
    with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=str(tiny_checkpoint), devices="cpu:1")) as handle:
        yield handle


def _writer(base, tiny_checkpoint, server: ServerConfig, **engine) -> tuple[ServerThread, Engine]:
    main = base.engine
    model = chain_model(tiny_checkpoint, CHAIN)
    made = Engine(EngineConfig(checkpoint=str(tiny_checkpoint), **engine), main.tokenizer, main.pool, model)
    return ServerThread(server, engine=made).wait_ready(), made


@pytest.fixture(scope="module")
def writer(base, tiny_checkpoint):
    """One work slot and three more admitted: generations must not need the slot."""
    handle, engine = _writer(base, tiny_checkpoint, ServerConfig(port=0, http_port=0, max_concurrency=1, max_queue=3))
    yield handle
    handle.stop()
    engine.cpu_executor.shutdown()
    engine.scheduler.close()


@pytest.fixture(scope="module")
def http(writer):
    with httpx.Client(base_url=f"http://127.0.0.1:{writer.server.http_port}", timeout=120) as client:
        yield client


def _body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Say it."}], "chat_template_kwargs": {"thinking": False},
            **extra}


def _complete(http, **extra) -> ChatCompletion:
    reply = http.post("/v1/chat/completions", json=_body(**extra))
    assert reply.status_code == 200, reply.text
    return ChatCompletion.model_validate(reply.json())


def _stream(http, **extra) -> list[ChatCompletionChunk]:
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True, **extra)) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate_json(line) for line in lines[:-1]]


def test_the_reply_as_written(http):
    body = _complete(http)
    assert body.choices[0].message.content == REPLY and body.choices[0].finish_reason == "stop"
    assert body.usage.completion_tokens == TOKENS and body.choices[0].logprobs is None


def test_a_stop_string_spanning_two_tokens_ends_the_reply_before_it(http):
    """OpenAI: "the returned text will not contain the stop sequence"; "y," is the tokens y and ,."""
    body = _complete(http, stop="y,")
    assert body.choices[0].message.content == "He" and body.choices[0].finish_reason == "stop"
    assert body.usage.completion_tokens == 4  # the token that completed the match was generated
    chunks = _stream(http, stop=["zz", " c"])  # a list; streamed: nothing of the match ever goes out
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hey," and chunks[-1].choices[0].finish_reason == "stop"
    assert _complete(http, stop=["!"]).choices[0].message.content == TEXT  # the stray special is not text


def test_stop_token_ids_min_tokens_and_ignore_eos(http):
    body = _complete(http, stop_token_ids=[ord(",")])
    assert (body.choices[0].message.content, body.choices[0].finish_reason) == ("Hey", "stop")
    ignored = _complete(http, ignore_eos=True, max_tokens=14)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 14
    assert ignored.choices[0].message.content.startswith(REPLY)
    held = _complete(http, min_tokens=TOKENS + 2, max_tokens=TOKENS + 6)  # <|end_of_msg|> held back
    assert held.usage.completion_tokens >= TOKENS + 2
    early = _complete(http, min_tokens=6, stop="y,")  # no stop string within the first 6 tokens' text
    assert early.choices[0].message.content == REPLY


def test_logit_bias_and_skip_special_tokens(http):
    assert _complete(http, logit_bias={str(ord("H")): -100}).choices[0].message.content[:1] != "H"
    assert _complete(http, skip_special_tokens=False).choices[0].message.content == TEXT + " <|media_pad|> !"
    assert _complete(http, skip_special_tokens=False, spaces_between_special_tokens=False).choices[0].message.content \
        == TEXT + "<|media_pad|>!"
    penalised = _complete(http, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    assert penalised.choices[0].message.content == REPLY  # the chain never repeats: nothing to penalise


def test_n_choices_are_indexed_and_counted(http):
    body = _complete(http, n=3)
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert [c.message.content for c in body.choices] == [REPLY] * 3
    assert body.usage.completion_tokens == 3 * TOKENS and body.usage.prompt_tokens > 0
    chunks = _stream(http, n=2, stream_options={"include_usage": True})
    by_index: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert by_index == {0: REPLY, 1: REPLY}
    roles = [c.choices[0].index for c in chunks[:-1] if c.choices[0].delta.role == "assistant"]
    finishes = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason == "stop"]
    assert sorted(roles) == sorted(finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * TOKENS


def test_logprobs_in_openais_shape(http):
    body = _complete(http, logprobs=True, top_logprobs=2)
    content = body.choices[0].logprobs.content
    assert [e.token for e in content] == [*TEXT, "<|media_pad|>", "!"]
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    assert body.choices[0].logprobs.refusal is None
    streamed = [e for c in _stream(http, logprobs=True, top_logprobs=2) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == content
    assert _complete(http, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []


def test_every_parameter_on_the_grpc_face(writer):
    with VisionClient(writer.target, timeout=120) as client:
        events = list(client.generate([user("Say it.")], chat_kwargs={"thinking": False}, sampling={
            "n": 2, "logprobs": True, "top_logprobs": 1, "stop": [".!"], "seed": 3, "presence_penalty": 0.5,
            "repetition_penalty": 1.0, "skip_special_tokens": True}))
        extras = list(client.generate([user("Say it.")], chat_kwargs={"thinking": False}, sampling={
            "stop": ["t."], "include_stop_str_in_output": True, "temperature": 1.0, "min_p": 0.5}))
        spaced = list(client.generate([user("Say it.")], chat_kwargs={"thinking": False}, sampling={
            "skip_special_tokens": False, "spaces_between_special_tokens": False}))
        allowed = list(client.generate([user("Say it.")], chat_kwargs={"thinking": False}, max_new_tokens=3,
                                       sampling={"allowed_token_ids": [ord("z")]}))
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate([user("Say it.")], sampling={"presence_penalty": 3.0}))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "presence_penalty must be in [-2, 2], got 3.0"
    assert "".join(e.content_delta for e in extras) == "Hey, cat."  # min_p keeps only the chain at temperature 1
    assert "".join(e.content_delta for e in spaced) == TEXT + "<|media_pad|>!"
    assert "".join(e.content_delta for e in allowed) == "zzz"
    for index in (0, 1):
        mine = [e for e in events if e.index == index]
        assert "".join(e.content_delta for e in mine) == "Hey, cat"  # ".", the stray special, "!": ".!"
        assert [e.logprobs.chosen.token for e in mine if e.WhichOneof("event") == "logprobs"][:2] == ["H", "e"]
        assert mine[-1].finish.reason == pb.FINISH_REASON_STOP and mine[-1].finish.usage.completion_tokens == TOKENS


def test_a_batch_line_asks_for_n_and_stop_through_a_server(writer, tmp_path):
    lines, output = tmp_path / "lines.jsonl", tmp_path / "out.jsonl"
    lines.write_text(json.dumps({"custom_id": "a", "body": _body(n=2, stop="y,", logprobs=True)}) + "\n")
    done = subprocess.run([sys.executable, "-m", "service.cli", "batch", "--task", "caption", "--input", str(lines),
                           "--output", str(output), "--server", writer.target], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240)
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["response"]["status_code"] == 200, (done.stderr, row)
    body = ChatCompletion.model_validate(row["response"]["body"])
    assert [c.message.content for c in body.choices] == ["He", "He"]
    assert [e.token for e in body.choices[1].logprobs.content] == ["H", "e", "y", ","]


def test_generations_take_no_work_slot_and_a_leaving_client_frees_its_sequence(writer, http):
    """One work slot, four admitted: three streams run together in the batch (none waits for the
    slot), a fourth is admitted too, a fifth request is over capacity; streams whose clients leave
    leave the batch and free their caches."""
    scheduler = writer.engine.scheduler
    long = _body(stream=True, ignore_eos=True, max_tokens=4000)
    streams = [http.stream("POST", "/v1/chat/completions", json=long) for _ in range(4)]
    try:
        replies = [s.__enter__() for s in streams[:3]]
        lines = [reply.iter_lines() for reply in replies]  # kept: a dropped line iterator closes its stream
        for reply, line in zip(replies, lines, strict=True):
            assert reply.status_code == 200 and next(line).startswith("data: ")
        deadline = time.monotonic() + 30
        while scheduler.last_batch < 3:
            assert time.monotonic() < deadline, scheduler.last_batch
            time.sleep(0.01)
        assert streams[3].__enter__().status_code == 200
        assert writer.server.admission.admitted == 4
        overloaded = http.post("/v1/chat/completions", json=_body())
        assert overloaded.status_code == 429, overloaded.text
        assert "capacity" in ErrorResponse.model_validate(overloaded.json()).error.message
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    deadline = time.monotonic() + 30
    while not scheduler.idle:
        assert time.monotonic() < deadline, "the streams' sequences did not leave the batch"
        time.sleep(0.02)
    assert scheduler.kv.used == 0 and writer.server.admission.admitted == 0


def test_a_request_over_the_kv_pool_is_too_large_and_two_that_fill_it_run_in_turn(base, tiny_checkpoint):
    """A pool that holds one sequence of the model length (as vLLM checks at start): n prompts
    over the pool are a 413; two replies that each fill it both finish, the first first (the
    second waits for blocks, or is preempted when the pool runs dry and resumes)."""
    probe = base.engine.scheduler.kv
    prompt_tokens = _complete_tokens(base)
    blocks = probe.blocks_for(prompt_tokens + 64)
    states = base.engine.scheduler.max_num_seqs * SequenceCache.state_bytes(base.engine.model.cfg)
    handle, engine = _writer(base, tiny_checkpoint, ServerConfig(port=0, http_port=0),
                             kv_cache_bytes=blocks * probe.block_bytes + states, max_model_len=prompt_tokens + 64)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{handle.server.http_port}", timeout=120) as client:
            over = client.post("/v1/chat/completions", json=_body(max_tokens=1, n=blocks + 1))
            assert over.status_code == 413, over.text
            assert f"over the server's {blocks} (--kv-cache-memory-gb)" in ErrorResponse.model_validate(
                over.json()).error.message
            order: list[str] = []

            def ask(name: str) -> None:
                reply = client.post("/v1/chat/completions", json=_body(max_tokens=64, ignore_eos=True))
                assert reply.status_code == 200
                order.append(name)

            first = threading.Thread(target=ask, args=("first",))
            first.start()
            while engine.scheduler.running == 0:
                time.sleep(0.005)
            second = threading.Thread(target=ask, args=("second",))
            second.start()
            first.join(120)
            second.join(120)
            assert order == ["first", "second"] and engine.scheduler.kv.used == 0
    finally:
        handle.stop()
        engine.cpu_executor.shutdown()
        engine.scheduler.close()


def test_an_engine_whose_pool_cannot_hold_one_model_length_sequence_does_not_start(base, tiny_checkpoint):
    """As vLLM refuses to start: the pool (the budget less the KDA states) must hold one sequence
    of --max-model-len; one block short, the engine names both flags."""
    main = base.engine
    kv = main.scheduler.kv
    states = main.scheduler.max_num_seqs * SequenceCache.state_bytes(main.model.cfg)
    config = EngineConfig(checkpoint=str(tiny_checkpoint), max_model_len=64 * kv.pool.block_size,
                          kv_cache_bytes=63 * kv.block_bytes + states)
    with pytest.raises(ValueError, match=r"one sequence of the model length \(1,024 tokens\) needs 245,760 bytes"):
        Engine(config, main.tokenizer, main.pool, main.model)
    made = Engine(dataclasses.replace(config, kv_cache_bytes=64 * kv.block_bytes + states), main.tokenizer, main.pool,
                  main.model)
    assert made.scheduler.kv.max_tokens == 1024
    made.cpu_executor.shutdown()
    made.scheduler.close()


def _complete_tokens(base) -> int:
    """The prompt tokens of `_body()`'s chat (its usage on the base server)."""
    with VisionClient(base.target, timeout=120) as client:
        return client.count_tokens(messages=[user("Say it.")], chat_kwargs={"thinking": False}).num_tokens
