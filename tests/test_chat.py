"""Chat rendering: the rules the goldens do not pin (images, errors, options), and properties."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO_ROOT
from textcore import tokenizer as tk
from textcore.chat import CHAT_KWARGS, ChatError, Segment, render, render_ids, render_text, repair_tool_results

MARKERS = [name for name, _ in tk.NAMED_SPECIAL_TOKENS.values()] + ["<|kimi_image_placeholder|>"]
user_text = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(MARKERS)), max_size=6).map("".join)
IMAGE = "<|media_begin|>image 28x28<|media_content|><|media_pad|><|media_end|>"




def _json_value():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=8),
                        st.floats(allow_nan=False, allow_infinity=False))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                        max_leaves=6)


@st.composite
def conversations(draw):
    """Agentic conversations with tool calls, results (sometimes shuffled), names and content parts."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(user_text)})
    for turn in range(draw(st.integers(1, 3))):
        content = draw(st.one_of(user_text, st.lists(user_text.map(lambda t: {"type": "text", "text": t}),
                                                     min_size=1, max_size=2)))
        user = {"role": "user", "content": content}
        if draw(st.booleans()):
            user["name"] = draw(user_text)
        messages.append(user)
        n_calls = draw(st.integers(0, 3))
        calls = [{"id": f"id{turn}-{k}", "type": "function",
                  "function": {"name": draw(st.sampled_from(["bash", "grep", "a&\"b"])),
                               "arguments": draw(st.one_of(
                                   st.dictionaries(st.text(max_size=6), _json_value(), max_size=3),
                                   st.dictionaries(st.text(max_size=6), _json_value(), max_size=3).map(json.dumps),
                                   st.just("{not json")))}}
                 for k in range(n_calls)]
        assistant = {"role": "assistant", "content": draw(user_text), "reasoning_content": draw(user_text)}
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        results = [{"role": "tool", "tool_call_id": call["id"], "content": draw(user_text)} for call in calls]
        messages.extend(draw(st.permutations(results)))
    return messages


def _control_ids(ids: list[int]) -> list[int]:
    return [i for i in ids if i >= tk.NUM_BASE_TOKENS]


# ---------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=100, deadline=None)
@given(text=user_text, name=user_text, reasoning=user_text, arg=user_text)
def test_user_strings_never_become_control_ids(tiny_tokenizer, text, name, reasoning, arg):
    def chat(t, n, r, a):
        return [{"role": "system", "content": t},
                {"role": "user", "content": [{"type": "text", "text": t}], "name": n or "x"},
                {"role": "assistant", "content": t, "reasoning_content": r or "r",
                 "tool_calls": [{"id": "1", "function": {"name": n or "x", "arguments": {a or "k": a}}}]},
                {"role": "tool", "tool_call_id": "1", "content": t}]

    spelled = render_ids(tiny_tokenizer, chat(text, name, reasoning, arg))
    plain = render_ids(tiny_tokenizer, chat("t", "n", "r", "a"))
    # The control ids come from the renderer alone: the same ones, wherever the user spelled markers.
    assert _control_ids(spelled.ids) == _control_ids(plain.ids)
    assert tiny_tokenizer.decode(spelled.ids) == spelled.text


@settings(max_examples=60, deadline=None)
@given(messages=conversations(), tools=st.one_of(st.none(), st.lists(st.dictionaries(st.text(max_size=4),
                                                                                      _json_value(), max_size=3),
                                                                      max_size=2)))
def test_render_is_deterministic_and_does_not_mutate(messages, tools):
    before = copy.deepcopy((messages, tools))
    first = render(messages, tools, tool_choice="required", response_format={"type": "json_object"})
    assert (messages, tools) == before
    assert render(copy.deepcopy(messages), copy.deepcopy(tools), tool_choice="required",
                  response_format={"type": "json_object"}) == first
    assert all(isinstance(s, Segment) and s.text for s in first)


@settings(max_examples=80, deadline=None)
@given(messages=conversations())
def test_tool_result_repair_is_idempotent_and_restores_call_order(messages):
    before = copy.deepcopy(messages)
    repaired = repair_tool_results(messages)
    assert messages == before
    assert repair_tool_results(repaired) == repaired
    calls: dict[str, tuple[int, str]] = {}
    order: list[int] = []
    for message in repaired:
        if message["role"] == "assistant":
            calls = {c["id"]: (k, c["function"]["name"]) for k, c in enumerate(message.get("tool_calls", []))}
            order = []
        elif message["role"] == "tool":
            position, name = calls[message["tool_call_id"]]
            assert message["tool"] == name
            order.append(position)
            assert order == sorted(order)
    # Shuffled results render exactly like results given in call order.
    assert render(messages) == render(repaired)


# ---------------------------------------------------------------------------------------------
# Rules


def test_default_effort_is_max_and_none_turns_it_off():
    chat = [{"role": "user", "content": "hi"}]
    assert "`thinking_effort=max`" in render_text(chat)
    assert "thinking-effort" not in render_text(chat, thinking_effort=None)
    assert "`thinking_effort=low`" in render_text(chat, reasoning_effort="low")
    assert "`thinking_effort=high`" in render_text(chat, reasoning_effort="low", thinking_effort="high")
    assert "`thinking_effort=low`" in render_text(chat, reasoning_effort="low", thinking_effort=None)
    off = render_text(chat, reasoning_effort="none")
    assert "thinking-effort" not in off and off.endswith("<|open|>response<|sep|>")
    assert render_text(chat, enable_thinking=False) == off
    for bad in ("medium", "MAX", ""):
        with pytest.raises(ChatError, match="thinking_effort must be one of low, high, max"):
            render(chat, thinking_effort=bad)
    with pytest.raises(ChatError, match="reasoning_effort must be one of none, low, high, max"):
        render(chat, reasoning_effort="extreme", thinking_effort="max")


def test_every_assistant_turn_has_a_think_element():
    text = render_text([{"role": "assistant", "content": "x", "reasoning_content": "   "}],
                       add_generation_prompt=False, thinking_effort=None)
    assert text == ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
                    "<|open|>response<|sep|>x<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert "think" not in render_text([{"role": "assistant", "content": "x", "reasoning_content": "r"}],
                                      thinking=False, add_generation_prompt=False)


def test_images_become_one_special_segment_each(tiny_tokenizer):
    chat = [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {}},
                                         {"type": "image"}, {"type": "text", "text": "<|media_pad|>"}]}]
    prompts = [IMAGE, IMAGE.replace("28x28", "56x28")]
    segments = render(chat, image_prompts=prompts)
    assert [s for s in segments if s.text in prompts] == [Segment(p, True) for p in prompts]
    ids = tiny_tokenizer.encode_segments(segments)
    assert ids.count(tk.MEDIA_PAD_ID) == 2 and ids.count(tk.MEDIA_BEGIN_ID) == 2  # the typed one stays text
    with pytest.raises(ChatError, match=r"messages\[0\].content\[1\] is an image but no image_prompts"):
        render(chat)
    with pytest.raises(ChatError, match=r"content\[2\] is image #2 but only 1 image_prompts"):
        render(chat, image_prompts=prompts[:1])
    with pytest.raises(ChatError, match="3 image_prompts were given but the messages hold 2 images"):
        render(chat, image_prompts=prompts + [IMAGE])
    # The release's in-text placeholder is deliberately not spliced: user text stays text.
    text_only = [{"role": "user", "content": "<|kimi_image_placeholder|>"}]
    with pytest.raises(ChatError, match="1 image_prompts were given but the messages hold 0 images"):
        render(text_only, image_prompts=[IMAGE])


def test_tool_name_resolution_and_errors():
    calls = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {}}},
                                                                {"function": {"name": "b", "arguments": "{}"}}]}
    text = render_text([calls, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert 'role="tool" tool="a" index="1"' in text and 'role="tool" tool="b" index="2"' in text
    with pytest.raises(ChatError, match=r"messages\[0\] \(role tool\) needs a tool name"):
        render([{"role": "tool", "content": "out"}])
    with pytest.raises(ChatError, match=r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object"):
        render([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(ChatError, match=r"messages\[0\].tool_calls\[0\].function.name is missing"):
        render([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}])


@pytest.mark.parametrize(("messages", "kwargs", "field"), [
    ("hi", {}, "messages must be a list"),
    ([["user"]], {}, r"messages\[0\] must be an object"),
    ([{"content": "x"}], {}, r"messages\[0\].role is missing"),
    ([{"role": "wizard"}], {}, r"messages\[0\].role must be"),
    ([{"role": "user", "content": 3}], {}, r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], {}, r"messages\[0\].content\[0\].text must be a string"),
    ([{"role": "user", "content": "x"}], {"tool_choice": "sometimes"}, "tool_choice must be one of"),
    ([{"role": "user", "content": "x"}], {"response_format": 3}, "response_format must be an object"),
    ([{"role": "user", "content": "x"}], {"model": "k3"}, "unknown chat option"),
    ([{"role": "user", "content": "x"}], {"thinking": "yes"}, "thinking must be true or false"),
    ([{"role": "user", "content": "x"}], {"response_format": {"type": "json_schema"}, "response_schema": {1j}},
     "response schema is not JSON-serialisable"),
    ([{"role": "user", "content": "x"}], {"tools": {1: "a", "b": 2}}, "tools is not JSON-serialisable with sortable"),
])
def test_bad_requests_name_the_field(messages, kwargs, field):
    with pytest.raises(ChatError, match=field):
        render(messages, **kwargs)


def test_chat_kwargs_are_what_render_takes():
    """The one list of chat-template keyword arguments: render's keyword options bar image_prompts
    (the engine's own), each of them accepted, anything else refused with the allowed list named."""
    keyword = {name for name, parameter in inspect.signature(render).parameters.items()
               if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(CHAT_KWARGS) == keyword - {"image_prompts"}
    assert set(CHAT_KWARGS) == {"add_generation_prompt", "thinking", "enable_thinking", "reasoning_effort",
                                "thinking_effort", "tool_choice", "response_format", "response_schema"}
    messages = [{"role": "user", "content": "x"}]
    values = {"add_generation_prompt": False, "thinking": False, "enable_thinking": False, "reasoning_effort": "low",
              "thinking_effort": "high", "tool_choice": "none", "response_format": {"type": "json_object"},
              "response_schema": {"type": "object"}}
    schema_format = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}}
    for name in CHAT_KWARGS:  # each one changes the prompt (response_schema: of a json_schema format)
        base = schema_format if name == "response_schema" else {}
        assert render_text(messages, **base, **{name: values[name]}) != render_text(messages, **base), name
    with pytest.raises(ChatError, match=r"unknown chat option\(s\) \['model'\]; allowed: \['add_generation_prompt'"):
        render(messages, model="k3")


def test_tool_choice_and_response_format_come_last():
    text = render_text([{"role": "user", "content": "x"}], [{"name": "f"}], tool_choice="none",
                       response_format={"type": "json_schema", "json_schema": {"schema": {"b": 1, "a": 2}}})
    assert text.index("tool-declare") < text.index("thinking-effort") < text.index("x<|close|>")
    assert text.index("x<|close|>") < text.index("tool-choice") < text.index("response-format")
    assert '{"a":2,"b":1}' in text
    assert "tool-choice" not in render_text([{"role": "user", "content": "x"}], tool_choice="auto")


def test_render_chat_cli_prints_text_and_ids(tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "low"}))
    run = [sys.executable, "-m", "service.cli", "render-chat", str(request)]
    env = {"PATH": "/usr/bin:/bin"}
    plain = subprocess.run(run, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>\n')
    with_ids = subprocess.run(run + ["--ids"], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert with_ids.returncode == 0, with_ids.stderr
    assert "tiny vocabulary" in with_ids.stderr
    out = json.loads(with_ids.stdout)
    assert out["text"] + "\n" == plain.stdout and out["ids"][0] == tk.OPEN_ID and out["ids"][-1] == tk.SEP_ID
    request.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "medium"}))
    bad = subprocess.run(run, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("render-chat: thinking_effort must be one of")
    assert "Traceback" not in bad.stderr


def test_long_attribute_values_render_like_short_ones():
    name = 'a&"b' * 300  # past the header cache's size bound
    segments = render([{"role": "user", "name": name, "content": "x"}], thinking_effort=None)
    assert segments[:10] == [Segment("<|open|>", True), Segment("message", False), Segment(" role", False),
                             Segment('="', False), Segment("user", False), Segment('"', False),
                             Segment(" name", False), Segment('="', False),
                             Segment("a&amp;&quot;b" * 300, False), Segment('"', False)]
