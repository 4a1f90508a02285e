"""Streaming output parser: round trips through the renderer, split invariance, error isolation."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from textcore import parser as p
from textcore import tokenizer as tk
from textcore.chat import render
from textcore.tokenizer import Tokenizer, TokenizerError

MARKERS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", 'key="x"', "&amp;", "&quot;"]
text = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(MARKERS)), max_size=5).map("".join)
json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=False, allow_infinity=False),
              text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)), max_leaves=6)




def completion_ids(tiny_tokenizer: Tokenizer, message: dict, thinking: bool = True) -> list[int]:
    """What the model emits after the generation prompt for `message` (the rendered turn minus the prompt)."""
    turn = render([message], add_generation_prompt=False, thinking_effort=None, thinking=thinking)
    prompt = render([], thinking_effort=None, thinking=thinking)
    assert turn[:len(prompt)] == prompt
    return tiny_tokenizer.encode_segments(turn[len(prompt):])


def feed_split(tiny_tokenizer: Tokenizer, ids: list[int], cuts: list[int], thinking: bool = True):
    parser = p.StreamParser(tiny_tokenizer, thinking=thinking)
    events, start = [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        events += parser.feed(ids[start:cut])
        start = cut
    events += parser.close()
    return merged(events), parser.finish()


def merged(events: list) -> list:
    """Join consecutive deltas of the same stream (how they are chunked depends on the split)."""
    out: list = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, p.ReasoningDelta | p.ContentDelta | p.ToolArgumentDelta) and type(last) is type(event) \
                and dataclasses.replace(last, text="") == dataclasses.replace(event, text=""):
            out[-1] = dataclasses.replace(last, text=last.text + event.text)
        else:
            out.append(event)
    return out


@st.composite
def assistant_turns(draw):
    calls = [{"id": str(k), "function": {"name": draw(st.sampled_from(["bash", 'we&ird"name', "f_1"])),
                                         "arguments": draw(st.dictionaries(text, json_value, max_size=4))}}
             for k in range(draw(st.integers(0, 3)))]
    message = {"role": "assistant", "reasoning_content": draw(text), "content": draw(text)}
    if calls:
        message["tool_calls"] = calls
    return message


@settings(max_examples=80, deadline=None)
@given(message=assistant_turns(), data=st.data())
def test_round_trip_and_split_invariance(tiny_tokenizer, message, data):
    ids = completion_ids(tiny_tokenizer, message)
    expected = {
        "reasoning_content": message["reasoning_content"] if message["reasoning_content"].strip() else "",
        "content": message["content"],
        "tool_calls": [{"name": c["function"]["name"], "index": k, "arguments": c["function"]["arguments"],
                        "errors": []} for k, c in enumerate(message.get("tool_calls", []), start=1)],
        "stopped": True,
    }
    whole_events, whole = feed_split(tiny_tokenizer, ids, [])
    assert whole == expected
    assert not [e for e in whole_events if isinstance(e, p.ProtocolError | p.ToolArgumentError)]
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=12))
    assert feed_split(tiny_tokenizer, ids, cuts) == (whole_events, whole)
    one_by_one = feed_split(tiny_tokenizer, ids, list(range(len(ids))))
    assert one_by_one == (whole_events, whole)


def test_call_is_announced_before_any_argument_byte(tiny_tokenizer):
    message = {"role": "assistant", "content": "ok", "tool_calls": [
        {"function": {"name": "bash", "arguments": {"command": "ls -la", "timeout": 30}}}]}
    ids = completion_ids(tiny_tokenizer, message)
    parser = p.StreamParser(tiny_tokenizer)
    seen: list = []
    for i, token_id in enumerate(ids):
        events = parser.feed([token_id])
        if any(isinstance(e, p.ToolCallStart) for e in events):
            assert events == [p.ToolCallStart(1, "bash")]
            assert token_id == tk.SEP_ID and ids[i + 1] == tk.OPEN_ID  # the next token opens the first argument
        seen += events
    kinds = [type(e).__name__ for e in merged(seen)]
    assert kinds == ["ContentDelta", "ToolCallStart", "ToolArgumentDelta", "ToolArgumentDone", "ToolArgumentDelta",
                     "ToolArgumentDone", "ToolCallEnd", "Stop"]
    deltas = [e for e in merged(seen) if isinstance(e, p.ToolArgumentDelta)]
    assert deltas == [p.ToolArgumentDelta(1, "command", "string", "ls -la"), p.ToolArgumentDelta(1, "timeout", "number",
                                                                                                "30")]


def _call_ids(tiny_tokenizer: Tokenizer, *arguments: tuple[str, str, str]) -> list[int]:
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in arguments)
    return tiny_tokenizer.encode(
        '<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        f'<|open|>call tool="f" index="1"<|sep|>{body}<|close|>call<|sep|><|close|>tools<|sep|>'
        "<|close|>message<|sep|><|end_of_msg|>", allow_special=True)


def test_a_bad_argument_does_not_poison_its_siblings(tiny_tokenizer):
    ids = _call_ids(tiny_tokenizer, ("a", "number", "12"), ("b", "number", "twelve"), ("c", "object", "[1]"),
                    ("d", "boolean", "true"), ("e", "mystery", "1"), ("a", "string", "again"))
    parser = p.StreamParser(tiny_tokenizer)
    events = parser.feed(ids)
    errors = [(e.key, e.message) for e in events if isinstance(e, p.ToolArgumentError)]
    assert [key for key, _ in errors] == ["b", "c", "e", "a"]
    assert "not valid JSON for type number" in errors[0][1] and "JSON list where type object" in errors[1][1]
    assert "unknown argument type" in errors[2][1] and "duplicate" in errors[3][1]
    call = parser.finish()["tool_calls"][0]
    assert call["arguments"] == {"a": 12, "d": True}
    assert [e["key"] for e in call["errors"]] == ["b", "c", "e", "a"]


def test_unparsable_arguments_come_back_as_a_json_block_error(tiny_tokenizer):
    message = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    parser = p.StreamParser(tiny_tokenizer)
    events = parser.feed(completion_ids(tiny_tokenizer, message))
    assert [e for e in events if isinstance(e, p.ToolArgumentError)][0].raw == "{oops"
    good = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
    ids = tiny_tokenizer.encode(
        '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>'
        '{"x": 1}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', allow_special=True)
    parser = p.StreamParser(tiny_tokenizer, thinking=False)
    parser.feed(tiny_tokenizer.encode("<|close|>response<|sep|>", allow_special=True) + ids)
    assert parser.finish()["tool_calls"][0]["arguments"] == good["tool_calls"][0]["function"]["arguments"]


def test_stop_truncation_and_stray_tokens(tiny_tokenizer):
    parser = p.StreamParser(tiny_tokenizer, thinking=False)
    events = parser.feed(tiny_tokenizer.encode("hi<|media_pad|> there<|close|>response<|sep|><|close|>message<|sep|>"
                                    "<|end_of_msg|>more<|end_of_msg|>", allow_special=True))
    assert events[-2] == p.Stop(tk.END_OF_MSG_ID)
    assert isinstance(events[-1], p.ProtocolError) and "after <|end_of_msg|>" in events[-1].message
    assert any(isinstance(e, p.ProtocolError) and "<|media_pad|>" in e.message for e in events)
    assert parser.finish()["content"] == "hi there" and parser.finish()["stopped"]
    with pytest.raises(RuntimeError):
        parser.feed([1])
    # a stray special is text then, set apart by spaces (vLLM's spaces_between_special_tokens) unless asked not to
    stray = tiny_tokenizer.encode("hi<|media_pad|> there<|close|>response<|sep|>", allow_special=True)
    for spaced, content in ((False, "hi<|media_pad|> there"), (True, "hi <|media_pad|>  there")):
        kept = p.StreamParser(tiny_tokenizer, thinking=False, skip_special_tokens=False,
                              spaces_between_special_tokens=spaced)
        kept.feed(stray)
        assert kept.finish()["content"] == content

    truncated = p.StreamParser(tiny_tokenizer)
    truncated.feed(_call_ids(tiny_tokenizer, ("a", "string", "complete"), ("b", "string", "cut off"))[:-14])
    result = truncated.finish()
    assert result["stopped"] is False
    assert result["tool_calls"][0]["arguments"] == {"a": "complete"}
    assert {e["message"] for e in result["tool_calls"][0]["errors"]} >= {"the argument was not closed"}


def test_grammar_violations_are_reported_not_fatal(tiny_tokenizer):
    parser = p.StreamParser(tiny_tokenizer)
    events = parser.feed(tiny_tokenizer.encode(
        "r<|close|>think<|sep|>loose text<|open|>banner<|sep|>x<|close|>banner<|sep|>"
        "<|open|>response<|sep|>c<|close|>nothing<|sep|>", allow_special=True))
    messages = [e.message for e in events if isinstance(e, p.ProtocolError)]
    assert any("loose text" in m for m in messages)
    assert any("'banner' is not expected inside message" in m for m in messages)
    assert any("closes no open element" in m for m in messages)
    assert parser.finish()["reasoning_content"] == "r" and parser.finish()["content"] == "c"


def test_multibyte_characters_split_across_tokens(tiny_tokenizer):
    message = {"role": "assistant", "reasoning_content": "思考 👋🏽", "content": "你好 🇯🇵"}
    ids = completion_ids(tiny_tokenizer, message)
    events, result = feed_split(tiny_tokenizer, ids, list(range(len(ids))))
    assert result["reasoning_content"] == "思考 👋🏽" and result["content"] == "你好 🇯🇵"
    assert "\ufffd" not in "".join(getattr(e, "text", "") for e in events)


def test_ids_outside_the_vocabulary_are_refused(tiny_tokenizer):
    with pytest.raises(TokenizerError):
        p.StreamParser(tiny_tokenizer).feed([tiny_tokenizer.num_base_tokens + 5])


def test_stopping_inside_a_call_settles_it(tiny_tokenizer):
    ids = tiny_tokenizer.encode('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                     '<|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>'
                     '<|open|>argument key="b" type="string"<|sep|>half<|end_of_msg|>', allow_special=True)
    parser = p.StreamParser(tiny_tokenizer)
    events = parser.feed(ids)
    assert [type(e).__name__ for e in events[-3:]] == ["ToolArgumentError", "ToolCallEnd", "Stop"]
    result = parser.finish()
    assert result["stopped"] and result["tool_calls"][0]["arguments"] == {"a": 1}
    assert [e["message"] for e in result["tool_calls"][0]["errors"]] == ["the argument was not closed",
                                                                         "the call was not closed"]


def _text(events) -> str:
    assert all(isinstance(e, p.ContentDelta) for e in events)
    return "".join(e.text for e in events)


@pytest.mark.parametrize(("skip", "spaced", "text"), [
    (True, True, "a <|open|>  b\u00e9"),  # <|open|> is not flagged special: it stays, as in a Hugging Face decode
    (True, False, "a<|open|> b\u00e9"),
    (False, True, "a <|media_pad|> <|open|>  b\u00e9"),
    (False, False, "a<|media_pad|><|open|> b\u00e9"),
])
def test_a_completion_is_decoded_as_plain_text(tiny_tokenizer, skip, spaced, text):
    """A completion's ids have no grammar: every token is text (a character split over tokens comes
    whole), specials as their names unless skipped, and <|end_of_msg|> ends it."""
    ids = tiny_tokenizer.encode("a<|media_pad|><|open|> b\u00e9", allow_special=True)
    decoder = p.output_parser(tiny_tokenizer, turn=False, thinking=False, skip_special_tokens=skip,
                              spaces_between_special_tokens=spaced)
    events = [e for token_id in ids[:-1] for e in decoder.feed([token_id])]  # the last byte of \u00e9 still to come
    assert not _text(events).endswith("\ufffd")
    events += decoder.feed([ids[-1], tk.END_OF_MSG_ID, *tiny_tokenizer.encode("after")]) + decoder.close()
    assert _text(events) == text
    assert isinstance(p.output_parser(tiny_tokenizer, turn=True, thinking=False, skip_special_tokens=True,
                                      spaces_between_special_tokens=True), p.StreamParser)
