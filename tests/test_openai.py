"""The OpenAI chat-completions wire format (service/openai): request bodies, image URLs fetched by
the rules of each face (a real HTTP server on 127.0.0.1 for the remote cases), response objects."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import re
import time

import pytest
from image_upstream import ImageUpstream
from openai_schema import ChatCompletion, ChatCompletionChunk

from service.batch.backends import _engine_item
from service.batch.inputs import load_items
from service.batch.spec import JobSpec
from service.engine import ChatInput, Choice, GenerationResult, Logprobs, TokenLogprob
from service.errors import BadRequest, Kind, TooLarge, Unavailable, Unsupported, classify
from service.fetch import MediaFetcher, _CheckedBackend, refused_address
from service.jsontext import MAX_JSON_DEPTH, parse_json
from service.media import MediaRef, image_url
from service.openai.request import TEMPLATE, Streaming, parse_chat_request, parse_completion_request
from service.openai.response import Reply, chunk, completion, error_body, logprobs_entry
from service.rpc.convert import event
from textcore import parser as p
from textcore.chat import CHAT_KWARGS, ChatError
from textcore.generate import SamplingError, SamplingParams

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAIAAAD9b0jDAAAAJ0lEQVR4nGNsaGhgoDZgorqJo4aOGjpq6Kiho4aOGjpq6Kihg9JQAP1uAbgMp"
    "B0oAAAAAElFTkSuQmCC")
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def _body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": "What is it?"}]}], **extra}


def test_a_body_becomes_template_messages_image_parts_and_settings():
    request = parse_chat_request(_body(max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, n=1,
                                       presence_penalty=0, stream=True, stream_options={"include_usage": True},
                                       reasoning_effort="low", chat_template_kwargs={"thinking": False}))
    content = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert request.chat.messages == [{"role": "user", "content": content}]
    assert request.media == [MediaRef(DATA_URL, "messages[0].content[0]")]
    assert (request.model, request.params.max_new_tokens) == ("m", 7)
    assert request.streaming == Streaming(stream=True, include_usage=True, continuous_usage=False)
    assert request.params == SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, n=1)
    assert request.chat.kwargs == {"reasoning_effort": "low", "thinking": False}
    item = request.media[0].input(PNG)
    assert item.data == PNG and item.where == "messages[0].content[0]"
    assert parse_chat_request(_body(max_tokens=2)).params.max_new_tokens == 2  # the older name
    part = {"type": "image_url", "image_url": {"url": DATA_URL}, "uuid": "client-7"}
    uuid_request = parse_chat_request({"messages": [{"role": "user", "content": [part]}]})
    assert uuid_request.media[0].input(PNG).uuid == "client-7"


@pytest.mark.parametrize("detail", ["auto", "low", "high", None])
def test_an_image_part_takes_openais_detail_which_changes_nothing(detail):
    """The one image-part rule: `detail` is accepted (K3's processor has one preprocessing), any
    other field is refused by name, on the chat route as on SGLang's `/encode`."""
    spec = {"url": DATA_URL, "detail": detail}
    part = {"type": "image_url", "image_url": spec}
    request = parse_chat_request({"messages": [{"role": "user", "content": [part]}]})
    assert request.media == [MediaRef(DATA_URL, "messages[0].content[0]")]
    with pytest.raises(BadRequest, match="detail must be one of"):
        image_url({"url": DATA_URL, "detail": "ultra"}, "x")
    with pytest.raises(Unsupported, match=r"\['resize'\] are not supported"):
        image_url({"url": DATA_URL, "resize": "fast"}, "x")


def test_the_sampling_parameters_of_openai_and_vllm_become_sampling_params():
    """Every parameter the issue lists is honoured, under its OpenAI / vLLM name, as the
    `SamplingParams` field of the same name (`stop` as a string or a list, `logit_bias` keys as
    JSON's string keys)."""
    body = _body(stop="END", n=3, logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                 repetition_penalty=1.2, min_tokens=2, ignore_eos=True, logit_bias={"17": 5, "3": -100.0},
                 stop_token_ids=[163585], skip_special_tokens=False, temperature=0.7, seed=9, min_p=0.1,
                 include_stop_str_in_output=True, spaces_between_special_tokens=False, use_beam_search=False,
                 length_penalty=1.0, priority=0, allowed_token_ids=[1, 2])
    params = parse_chat_request(body).params
    assert params == SamplingParams(max_new_tokens=None, stop=("END",), n=3, logprobs=True, top_logprobs=2,
                                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=2,
                                    ignore_eos=True, logit_bias={17: 5.0, 3: -100.0}, stop_token_ids=(163585,),
                                    skip_special_tokens=False, temperature=0.7, seed=9, min_p=0.1,
                                    include_stop_str_in_output=True, spaces_between_special_tokens=False,
                                    allowed_token_ids=(1, 2))
    assert parse_chat_request(_body(stop=["a", "b"])).params.stop == ("a", "b")


@pytest.mark.parametrize(("extra", "error", "words"), [
    ({"n": 0}, SamplingError, "^n must be >= 1, got 0$"),
    ({"n": 1.5}, BadRequest, "n must be an integer"),
    ({"stop": ["a", 3]}, BadRequest, "stop must be a string or a list of strings"),
    ({"stop": [""]}, SamplingError, "stop must hold non-empty strings"),
    ({"frequency_penalty": 2.5}, SamplingError, r"^frequency_penalty must be in \[-2, 2\], got 2.5$"),
    ({"presence_penalty": "a lot"}, BadRequest, "presence_penalty must be a number"),
    ({"repetition_penalty": 0}, SamplingError, "repetition_penalty must be > 0"),
    ({"logit_bias": {"x": 1}}, BadRequest, r"logit_bias must hold token ids \(integers from 0\), got 'x'"),
    ({"logit_bias": {"1": "up"}}, BadRequest, r"logit_bias\['1'\] must be a number"),
    ({"logit_bias": {"1": 300}}, SamplingError, r"logit_bias\[1\] must be in \[-100, 100\], got 300.0"),
    ({"logit_bias": [1]}, BadRequest, "logit_bias must be an object"),
    ({"top_logprobs": 3}, SamplingError, "top_logprobs needs logprobs to be true"),
    ({"logprobs": 1}, BadRequest, "logprobs must be true or false"),
    ({"min_tokens": 9, "max_tokens": 4}, SamplingError, r"min_tokens must be from 0 to max_new_tokens \(4\), got 9"),
    ({"stop_token_ids": [-1]}, BadRequest, "stop_token_ids must hold token ids"),
    ({"ignore_eos": "yes"}, BadRequest, "ignore_eos must be true or false"),
    ({"parallel_tool_calls": False}, Unsupported, "parallel_tool_calls=False is not supported"),
    ({"max_tokens": 0}, BadRequest, "max_tokens must be an integer from 1 to"),
    ({"temperature": "hot"}, BadRequest, "temperature must be a number"),
    ({"temperature": -0.5}, SamplingError, r"^temperature must be >= 0, got -0.5$"),
    ({"top_p": 0}, SamplingError, r"^top_p must be in \(0, 1\], got 0.0$"),
    ({"top_p": 5}, SamplingError, r"^top_p must be in \(0, 1\], got 5.0$"),
    ({"top_k": -1}, SamplingError, r"^top_k must be >= 0, got -1$"),
    ({"top_k": 1.5}, BadRequest, r"^top_k must be an integer up to 2147483647, got 1.5$"),
    ({"top_k": 2**31}, BadRequest, r"^top_k must be an integer up to 2147483647, got 2147483648$"),
    ({"seed": 2**64}, BadRequest, "seed must be an integer from 0 to 18446744073709551615"),
    ({"seed": -1}, BadRequest, "seed must be an integer from 0 to 18446744073709551615"),
    ({"chat_template_kwargs": {"secret": 1}}, ChatError, r"unknown chat option\(s\) \['secret'\]; allowed: "),
    ({"allowed_token_ids": 3}, BadRequest, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": []}, SamplingError, "allowed_token_ids must not be empty"),
    ({"min_p": 1.5}, SamplingError, r"^min_p must be in \[0, 1\], got 1.5$"),
    ({"min_p": "low"}, BadRequest, "min_p must be a number"),
    ({"include_stop_str_in_output": 1}, BadRequest, "include_stop_str_in_output must be true or false"),
    ({"use_beam_search": True}, Unsupported, "use_beam_search=True is not supported"),
    ({"priority": 3}, Unsupported, "priority=3 is not supported"),
    ({"prompt_logprobs": 1}, Unsupported, r"unsupported parameter\(s\) \['prompt_logprobs'\]"),
    ({"bad_words": ["x"]}, Unsupported, r"unsupported parameter\(s\) \['bad_words'\]"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus_key": 1}}, BadRequest,
     r"stream_options has unknown field\(s\) \['bogus_key'\]"),
    ({"stream": True, "stream_options": [1]}, BadRequest, "stream_options must be an object"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, BadRequest,
     "stream_options.include_usage must be true, false or null"),
    ({"stream_options": {"include_usage": True}}, BadRequest, "stream_options can only be given with stream: true"),
])
def test_every_parameter_is_honoured_neutral_or_refused_by_name(extra, error, words):
    with pytest.raises(error, match=words):
        parse_chat_request(_body(**extra))
    assert parse_chat_request(_body(stop=[], n=1, logprobs=False, user="u")).params.max_new_tokens is None
    with pytest.raises(Unsupported, match=r"unsupported parameter\(s\) \['best_of'\]"):
        parse_chat_request(_body(best_of=2))


@pytest.mark.parametrize(("options", "streaming"), [
    ({"include_usage": True, "continuous_usage_stats": True}, Streaming(True, True, True)),
    ({"include_usage": False, "continuous_usage_stats": True}, Streaming(True, False, False)),  # as vLLM: needs both
    ({"include_usage": True}, Streaming(True, True, False)),
    ({}, Streaming(True, False, False)),
])
def test_stream_options_are_checked_and_continuous_usage_needs_include_usage(options, streaming):
    assert parse_chat_request(_body(stream=True, stream_options=options)).streaming == streaming
    assert parse_completion_request({"prompt": "x", "stream": True, "stream_options": options}).streaming == streaming


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("Hi", ["Hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_a_completions_prompt_in_each_of_vllms_four_forms(prompt, prompts):
    request = parse_completion_request({"prompt": prompt, "logprobs": 2, "min_p": 0.05, "echo": False})
    assert request.prompts == prompts
    assert request.params == SamplingParams(max_new_tokens=16, logprobs=True, top_logprobs=2, min_p=0.05)
    assert parse_completion_request({"prompt": "x", "max_tokens": None}).params.max_new_tokens is None  # the room left


@pytest.mark.parametrize(("extra", "error", "words"), [
    ({"prompt": []}, BadRequest, "prompt must be a string, a list of strings"),
    ({"prompt": ["a", [1]]}, BadRequest, "prompt must hold strings or lists of token ids, not both"),
    ({"prompt": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}, Unsupported,
     "Images are a chat feature: send them as image_url parts to /v1/chat/completions"),
    ({"prompt": [[1, "2"]]}, BadRequest, r"prompt\[0\] must be a string or a list of token ids"),
    ({"prompt": ["x"] * 1025}, TooLarge, "prompt holds 1025 prompts; this server takes at most 1024"),
    ({"prompt": "x", "suffix": "y"}, Unsupported, "suffix is not supported"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, Unsupported, "echo with logprobs needs the prompt's logprobs"),
    ({"prompt": "x", "logprobs": True}, BadRequest, "logprobs must be an integer from 0 to 20"),
    ({"prompt": "x", "logprobs": 21}, BadRequest, "logprobs must be an integer from 0 to 20"),
    ({"prompt": "x", "top_logprobs": 2}, Unsupported, r"unsupported parameter\(s\) \['top_logprobs'\]"),
    ({"prompt": "x", "messages": []}, Unsupported, r"unsupported parameter\(s\) \['messages'\]"),
    ({"prompt": "x", "temperature": 9}, SamplingError, "temperature must be <= 2"),
    ({"max_tokens": 3}, BadRequest, "prompt is required"),
])
def test_a_completions_body_is_refused_by_name(extra, error, words):
    with pytest.raises(error, match=words):
        parse_completion_request(extra)


def test_chat_template_kwargs_carry_every_option_the_template_takes():
    """chat_template_kwargs may set any of the template's keyword arguments (vLLM passes them through
    to the template), the OpenAI parameters the template reads among them; nothing else."""
    assert set(TEMPLATE) <= set(CHAT_KWARGS)
    options = {"tool_choice": "none", "response_format": {"type": "json_schema"}, "response_schema": {"type": "object"},
               "thinking_effort": "low", "add_generation_prompt": True}
    request = parse_chat_request(_body(reasoning_effort="high", chat_template_kwargs=options))
    assert request.chat.kwargs == {"reasoning_effort": "high", **options}
    for key in ("image_prompts", "secret"):  # image_prompts is the engine's own
        with pytest.raises(ChatError, match=rf"unknown chat option\(s\) \['{key}'\]; allowed: "
                                            r"\['add_generation_prompt', 'thinking', ") as refused:
            parse_chat_request(_body(chat_template_kwargs={key: 1}))
    with pytest.raises(ChatError) as engine_refused:  # the gRPC face's (its options become ChatInput's kwargs)
        ChatInput([{"role": "user", "content": "x"}], kwargs={"image_prompts": ["x"]})
    assert str(engine_refused.value) == str(refused.value).replace("secret", "image_prompts")


def test_json_nested_too_deep_is_bad_input_on_every_reader(tmp_path):
    """The depth rule is parse_json's (an HTTP body, a gRPC JSON field) and a batch line's alike, also
    where json itself gives up (Python's recursion limit)."""
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "the request body")
    for levels in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(BadRequest, match=f"^the request body nests deeper than {MAX_JSON_DEPTH} levels$"):
            parse_json("[" * levels + "]" * levels, "the request body")
    source = tmp_path / "deep.jsonl"
    good = {"custom_id": "ok", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    source.write_text(json.dumps(good) + "\n" + '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000
                      + "}\n")
    assert [(item.custom_id, item.problem) for item in load_items(source, JobSpec("caption"))] == [
        ("ok", None), ("<line 2>", f"the line nests deeper than {MAX_JSON_DEPTH} levels")]


def test_malformed_messages_name_the_field():
    for messages, words in [([], "messages must be a non-empty list"),
                            ([{"content": "x"}], r"messages\[0\] must be an object with a string role"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}],
                             r"messages\[0\].content\[0\].image_url: an image's url"),
                            ([{"role": "user", "content": [{"type": "input_audio"}]}], "input_audio parts"),
                            ([{"role": "user", "content": 5}], "content must be a string or a list")]:
        with pytest.raises((BadRequest, Unsupported), match=words):
            parse_chat_request({"messages": messages})


@pytest.fixture(scope="module")
def web():
    with ImageUpstream(PNG) as upstream:
        yield upstream


def _fetch(fetcher: MediaFetcher, url: str) -> bytes:
    return asyncio.run(fetcher.fetch(MediaRef(url, "messages[0].content[0]")))


def _fetch_all(fetcher: MediaFetcher, *urls: str) -> list[bytes]:
    return asyncio.run(fetcher.fetch_all([MediaRef(url, f"messages[0].content[{i}]") for i, url in enumerate(urls)]))


LOOPBACK = ("127.0.0.1",)  # how tests allow their own upstream (--allowed-media-domains 127.0.0.1)


def test_remote_images_only_when_allowed_with_limits(web):
    assert classify(_raises(MediaFetcher(max_bytes=1 << 20), web.url("/image.png"))).message.endswith(
        "send the image as a data: URL")
    fetcher = MediaFetcher(max_bytes=len(PNG) * 10, allow_remote=True, timeout_s=1.0, max_redirects=2,
                           allowed_domains=LOOPBACK)
    assert _fetch(fetcher, web.url("/image.png")) == PNG
    assert _fetch(fetcher, web.url("/hop")) == PNG  # one redirect is fine
    cases = [("/big.png", TooLarge, "over the per-image limit"), ("/status/404", BadRequest, "HTTP 404"),
             ("/status/403", BadRequest, "HTTP 403"), ("/status/503", Unavailable, "HTTP 503"),
             ("/status/429", Unavailable, "HTTP 429"), ("/drip/3", Unavailable, "not fetched within 1 s"),
             ("/loop", BadRequest, "more than 2 redirects")]
    for path, error, words in cases:
        exc = _raises(fetcher, web.url(path))
        assert isinstance(exc, error) and words in str(exc), (path, exc)
        assert str(exc).startswith("messages[0].content[0]: ")
    refused = _raises(fetcher, "http://127.0.0.1:1/x.png")  # an allowed host, nothing listening: the network's
    assert isinstance(refused, Unavailable) and classify(refused).rule.retry


def test_a_redirect_hop_is_checked_like_the_first_url(web):
    """Out of http(s), or to a host the rules do not fetch: bad input, not a retryable failure."""
    fetcher = MediaFetcher(max_bytes=1 << 20, allow_remote=True, allowed_domains=LOOPBACK)
    before = web.hits["/image.png"]
    for target, words in (("file:///etc/passwd", "redirected to a file: URL"), ("ftp://host/x.png", "a ftp: URL"),
                          (web.url("/image.png", host="localhost"), "allowed domains ['127.0.0.1']; this one is "
                                                                      "from 'localhost'")):
        exc = _raises(fetcher, web.url("/to", target))
        assert isinstance(exc, BadRequest) and words in str(exc) and not classify(exc).rule.retry, exc
    assert web.hits["/image.png"] == before  # nothing was fetched from the host that is not listed


@pytest.mark.parametrize("address", ["127.0.0.1", "127.255.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1",
                                     "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1", "239.1.1.1",
                                     "240.0.0.1", "255.255.255.255", "192.0.2.1", "::1", "::", "fe80::1", "fc00::1",
                                     "fd12::1", "ff02::1", "fec0::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
                                     "::ffff:169.254.169.254", "2002:7f00:1::", "64:ff9b::a00:1", "2001:db8::1"])
def test_the_guard_refuses_every_address_that_is_not_public(address):
    assert refused_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "151.101.1.69", "2606:4700:4700::1111",
                                     "2a00:1450:4001:80b::200e", "::ffff:8.8.8.8"])
def test_the_guard_lets_public_addresses_through(address):
    assert not refused_address(ipaddress.ip_address(address))


def test_hosts_are_resolved_and_refused_before_any_connection(web):
    """Without an allow list only public hosts are fetched: an IP literal, a name (resolved here),
    an IPv4-mapped IPv6 literal of loopback, all refused with the same words, and nothing reaches
    the upstream, so a caller learns nothing of what listens there."""
    fetcher = MediaFetcher(max_bytes=1 << 20, allow_remote=True)
    before = sum(web.hits.values())
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "2130706433"):
        exc = _raises(fetcher, web.url("/image.png", host=host))
        assert isinstance(exc, BadRequest) and "is not a public address" in str(exc), (host, exc)
    closed = _raises(fetcher, "http://127.0.0.1:1/x.png")  # nothing listens: the same answer
    assert isinstance(closed, BadRequest) and "is not a public address" in str(closed)
    assert sum(web.hits.values()) == before


def test_the_connection_goes_to_the_address_that_was_checked(web):
    """The name is resolved once, in the step that connects, to the address the guard judged (no
    second lookup a rebinding DNS could answer differently); the request still names the host."""
    async def connect() -> tuple[str, set[str]]:
        resolved = {info[4][0] for info in await asyncio.get_running_loop().getaddrinfo("localhost", web.port)}
        stream = await _CheckedBackend(frozenset({"localhost"})).connect_tcp("localhost", web.port)
        try:
            return stream.get_extra_info("server_addr")[0], resolved
        finally:
            await stream.aclose()

    peer, resolved = asyncio.run(connect())
    assert peer in resolved
    trusting = MediaFetcher(max_bytes=1 << 20, allow_remote=True, allowed_domains=("localhost",))
    assert _fetch(trusting, web.url("/image.png", host="localhost")) == PNG
    assert web.hosts[-1] == f"localhost:{web.port}"


def test_a_requests_images_are_fetched_at_once_within_one_deadline(web):
    fetcher = MediaFetcher(max_bytes=1 << 20, allow_remote=True, timeout_s=5, allowed_domains=LOOPBACK)
    start = time.monotonic()
    assert _fetch_all(fetcher, *[web.url("/drip/1")] * 4, DATA_URL) == [PNG] * 5
    assert time.monotonic() - start < 2.5  # four 1-s transfers side by side, not one after another
    start = time.monotonic()
    exc = _raises_all(fetcher, web.url("/drip/4"), web.url("/status/404"))
    assert isinstance(exc, BadRequest) and "messages[0].content[1]" in str(exc) and "HTTP 404" in str(exc)
    assert time.monotonic() - start < 2  # the first failure ends the request: the slow one is stopped
    bounded = MediaFetcher(max_bytes=1 << 20, allow_remote=True, timeout_s=5, allowed_domains=LOOPBACK,
                           concurrency=2)
    start = time.monotonic()
    assert _fetch_all(bounded, *[web.url("/drip/1")] * 4) == [PNG] * 4
    assert time.monotonic() - start >= 1.9  # at most two at once
    late = MediaFetcher(max_bytes=1 << 20, allow_remote=True, timeout_s=1.5, allowed_domains=LOOPBACK)
    start = time.monotonic()
    exc = _raises_all(late, web.url("/drip/1"), web.url("/drip/4"))  # every read is quick; the transfer is not
    assert isinstance(exc, Unavailable) and "within 1.5 s" in str(exc)
    assert 1.4 < time.monotonic() - start < 3


def _raises_all(fetcher: MediaFetcher, *urls: str) -> Exception:
    with pytest.raises(Exception) as info:
        _fetch_all(fetcher, *urls)
    return info.value


def _raises(fetcher: MediaFetcher, url: str) -> Exception:
    with pytest.raises(Exception) as info:
        _fetch(fetcher, url)
    return info.value


def test_data_urls_always_local_files_only_with_a_base_dir(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    plain = MediaFetcher(max_bytes=1 << 20)
    assert _fetch(plain, DATA_URL) == PNG
    assert "does not read local files" in str(_raises(plain, "a.png"))
    batch = MediaFetcher(max_bytes=1 << 20, base_dir=tmp_path)
    assert _fetch(batch, "a.png") == PNG == _fetch(batch, f"file://{tmp_path / 'a.png'}")
    assert "no such file" in str(_raises(batch, "b.png"))
    assert "not valid base64" in str(_raises(plain, "data:image/png;base64,@@@"))
    assert isinstance(_raises(MediaFetcher(max_bytes=10), DATA_URL), TooLarge)
    assert "scheme 'ftp'" in str(_raises(batch, "ftp://host/x.png"))


def test_a_reply_as_a_completion_a_stream_and_an_error():
    reply = Reply()
    parts = [reply.add(Choice(0, item)) for item in (p.ReasoningDelta("hmm"), p.ContentDelta("A "),
                                                     p.ContentDelta("cat."), p.Stop(163586),
                                                     GenerationResult("stop", 30, 16, 4))]
    assert [part and part["delta"] for part in parts] == [{"reasoning": "hmm"}, {"content": "A "},
                                                          {"content": "cat."}, None, {}]
    assert parts[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    body = completion(reply, model="m", request_id="chatcmpl-1", created=5)
    assert body == {"id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "A cat.", "reasoning": "hmm"}, "logprobs": None,
         "finish_reason": "stop"}], "usage": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}}
    ChatCompletion.model_validate(body)
    tools = Reply()
    tools.add(Choice(0, p.ToolCallEnd(1, "get_weather", {"city": "Seoul"})))
    tools.add(Choice(0, GenerationResult("stop", 10, 0, 9)))
    message = completion(tools, model="m", request_id="x")["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Seoul"}'}
    streamed = chunk([parts[1]], model="m", request_id="x", created=1)
    assert streamed["choices"][0]["delta"] == {"content": "A "}
    ChatCompletionChunk.model_validate(streamed)
    usage = chunk([], model="m", request_id="x", created=1, usage=reply.usage())
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 34
    error = error_body(classify(TooLarge("too big")))
    assert error == {"error": {"message": "too big", "type": "invalid_request_error", "param": None, "code": 413}}
    assert classify(Unavailable("x")).kind == Kind.UNAVAILABLE


# The `openai` SDK's request types are the oracle for OpenAI's shapes.
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
          {"type": "custom", "custom": {"name": "grammar_tool", "format": {"type": "text"}}}]
_SHAPES = {
    "tools": [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}, "strict": None}},
        {"type": "function", "function": {"name": "f", "strict": True}},
        {"type": "function", "function": {"name": "f", "parameters": "{}"}},
        {"type": "function", "function": {"name": "f", "strict": "yes"}},
        {"type": "function", "function": {"name": "f", "argumnets": {}}},
        {"type": "function", "function": {"description": "no name"}},
        {"type": "function", "function": {"name": 7}},
        {"type": "function"},
        {"type": "function", "function": {"name": "f"}, "extra": 1},
        {"type": "custom", "custom": {"name": "c"}},
        {"type": "custom", "custom": {"name": "c", "format": {"type": "grammar", "grammar": {
            "definition": "start: x", "syntax": "lark"}}}},
        {"type": "custom", "custom": {"name": "c", "format": {"type": "grammar", "grammar": {
            "definition": "x", "syntax": "ebnf"}}}},
        {"type": "custom", "custom": {"name": "c", "format": {"type": "yaml"}}},
        {"type": "retrieval"}, "get_weather", None, [],
    ],
    "tool_choice": [
        "none", "auto", "required", "sometimes", 1, None,
        {"type": "function", "function": {"name": "get_weather"}},
        {"type": "function", "function": {}},
        {"type": "function", "name": "get_weather"},
        {"type": "custom", "custom": {"name": "grammar_tool"}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {
            "name": "get_weather"}}]}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "required"}},
    ],
    "response_format": [
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "answer"}},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True,
                                                "description": "d"}},
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, {"type": "xml"}, "json_object",
        {"type": "text", "strict": True}, None,
    ],
}


def _sdk_accepts(key: str, value) -> bool:
    from openai.types.chat import ChatCompletionToolChoiceOptionParam, ChatCompletionToolUnionParam
    from openai.types.chat.completion_create_params import ResponseFormat
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    shape = {"tools": ChatCompletionToolUnionParam, "tool_choice": ChatCompletionToolChoiceOptionParam,
             "response_format": ResponseFormat}[key]
    try:
        TypeAdapter(shape, config=ConfigDict(extra="forbid", strict=True)).validate_python(value)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(("key", "value"), [(key, value) for key, values in _SHAPES.items() for value in values])
def test_tools_tool_choice_and_response_format_have_openais_shapes(key, value):
    """Accepted exactly when the SDK's request type accepts it (an absent value: null); a refusal
    names the field (400)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": _TOOLS}
    body[key] = [value] if key == "tools" and value is not None else value
    expected = value is None or _sdk_accepts(key, value)
    try:
        parse_chat_request(body)
    except BadRequest as exc:
        assert not expected, exc
        assert str(exc).startswith(key), exc
        assert classify(exc).rule.http == 400
    else:
        assert expected, f"{key}={value!r} was accepted"


def test_the_rules_openai_states_beyond_the_shapes():
    message = [{"role": "user", "content": "hi"}]
    for extra, words in (({"tool_choice": "auto"}, "tool_choice 'auto' needs tools"),
                         ({"tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
                          "tool_choice.function.name 'other' is not one of the function tools given: ['get_weather']"),
                         ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
                          "tools[0].function.name must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'"),
                         ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "1 to 64"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "a.b"}}},
                          "response_format.json_schema.name must be 1 to 64")):
        with pytest.raises(BadRequest, match=re.escape(words)):
            parse_chat_request({"messages": message, **extra})
    assert parse_chat_request({"messages": message, "tool_choice": "none"}).chat.kwargs == {"tool_choice": "none"}


_TOKENS = {7: "A", 8: "B", 9: "é"}  # token id -> text


def _logprob(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(next(i for i, text in _TOKENS.items() if text == token), logprob)


def _logprobs(chosen: TokenLogprob, top: tuple[TokenLogprob, ...]) -> Logprobs:
    return Logprobs(chosen, top, lambda token_id: _TOKENS[token_id].encode())


def test_logprobs_read_back_from_a_servers_events_give_the_same_entries():
    """A Generate event carries each token's text and bytes (read by the gRPC face); a batch job
    run against the server reads them back from it, and reports the entries the engine's give."""
    item = _logprobs(_logprob("é", -1.0), (_logprob("é", -1.0), _logprob("B", -2.5)))
    wire = event(Choice(2, item))
    assert [(e.token, e.bytes) for e in (wire.logprobs.chosen, *wire.logprobs.top)] == [
        ("é", "é".encode()), ("é", "é".encode()), ("B", b"B")]
    back = _engine_item(wire)
    assert back.index == 2 and logprobs_entry(back.item) == logprobs_entry(item)


def test_choices_are_indexed_their_usage_summed_and_logprobs_in_openais_shape():
    """n choices, each with its own items; usage counts the prompt once and every choice's tokens;
    a token's logprobs go out with its choice's next chunk, and in `choices[].logprobs.content`
    (OpenAI's shape: token, logprob (-9999.0 for a token with none), bytes, top_logprobs)."""
    reply = Reply()
    first = _logprobs(_logprob("A", -0.5), (_logprob("A", -0.5), _logprob("B", float("-inf"))))
    parts = [reply.add(Choice(1, first)), reply.add(Choice(1, p.ContentDelta("A"))),
             reply.add(Choice(0, p.ContentDelta("x"))), reply.add(Choice(0, GenerationResult("length", 30, 16, 1))),
             reply.add(Choice(1, _logprobs(_logprob("é", -1.0), ()))),
             reply.add(Choice(1, GenerationResult("stop", 30, 16, 2)))]
    entry = {"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": [
        {"token": "A", "logprob": -0.5, "bytes": [65]}, {"token": "B", "logprob": -9999.0, "bytes": [66]}]}
    assert parts[0] is None and parts[1] == {"index": 1, "delta": {"content": "A"},
                                             "logprobs": {"content": [entry], "refusal": None}, "finish_reason": None}
    assert parts[2]["logprobs"] is None  # choice 0 did not ask (no logprobs came)
    last = {"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": []}
    assert parts[5] == {"index": 1, "delta": {}, "logprobs": {"content": [last], "refusal": None},
                        "finish_reason": "stop"}
    body = completion(reply, model="m", request_id="x", created=1)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["logprobs"] == {"content": [entry, last], "refusal": None}
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
    ChatCompletion.model_validate(body)
    for part in parts:
        if part is not None:
            ChatCompletionChunk.model_validate(chunk([part], model="m", request_id="x", created=1))
