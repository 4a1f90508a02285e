"""Kimi-K3 chat rendering: messages -> prompt segments, by the release's rules.

The prompt is XML-like, built from the non-special markers `<|open|>`, `<|close|>`, `<|sep|>`
and the stop token `<|end_of_msg|>`:

    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>

`render` returns `Segment`s. Markers (and image prompts made by `vision/`) are the only segments
encoded with specials allowed; everything else, including tag names, attributes, and all text
from the caller, is encoded as ordinary text, so no user string can forge a control id. Each
segment is encoded on its own, which is why the segmentation (e.g. ` role`, `="`, value, `"`)
matters: BPE never merges across a segment boundary.

Rules (the release's `build_chat_segments`, plus `thinking_effort` defaulting to "max" as in its
`apply_chat_template`):
- tool declarations (argument `tools`) come first, recursively key-sorted, as compact JSON;
- then a `thinking-effort` system message when thinking is on and an effort is set;
- a system message carrying `tools` declares them dynamically (its content is not rendered);
- an assistant turn always has a `think` element in thinking mode, then `response`, then its
  tool calls with typed arguments (an arguments string that is not JSON is kept whole in a
  `json` element);
- tool results are repaired (see `repair_tool_results`) and numbered per assistant turn;
- `tool_choice` ("required"/"none") and `response_format` become typed system messages after the
  conversation, right before the generation prompt.

`CHAT_KWARGS` names `render`'s keyword options (read from its signature): the one list of the
chat-template keyword arguments a request may set, on every face.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from textcore.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, Segment, Tokenizer

__all__ = ["CHAT_KWARGS", "ChatError", "Prompt", "Segment", "THINKING_EFFORTS", "check_chat_kwargs", "render",
           "render_ids", "render_text", "repair_tool_results"]

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
TOOL_CHOICES = ("auto", "none", "required")

_UNSET: Any = object()

_TOOL_DECLARE = (
    "# Tools\n"
    "Here are the available tools, described in JSONSchema.\n\n"
    "```json\n{}\n```"
)
_DYNAMIC_TOOL_DECLARE = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n{}\n```"
)
_THINKING_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any "
             "additional formatting.")
_JSON_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA = ("The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON + "\n"
                "The JSON data must match the following schema:\n```json\n{}\n```")


class ChatError(ValueError):
    """A chat request that cannot be rendered; the message names the offending field."""

    kind = "bad_input"  # in the service's error taxonomy (service.errors.Kind)


class Prompt(NamedTuple):
    text: str
    ids: list[int]


# ---------------------------------------------------------------------------------------------
# Small pure helpers


def deep_sort(value: Any) -> Any:
    """A copy of `value` with every mapping's keys sorted, recursively (same tools, same prefix)."""
    if isinstance(value, Mapping):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [deep_sort(item) for item in value]
    return value


def _sorted_json(value: Any, where: str) -> str:
    """Compact JSON of `value` with every mapping's keys sorted (the release's tool/schema form)."""
    try:
        return json.dumps(deep_sort(value), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ChatError(f"{where} is not JSON-serialisable with sortable keys: {exc}") from None


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def argument_type(value: Any) -> str:
    """The `type` attribute of a rendered tool-call argument."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    return "array"


def _argument_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ChatError(f"{where} is not JSON-serialisable: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Tool-result repair


def _call_positions(tool_calls: Any) -> dict[str, tuple[int, Any]]:
    """Assistant `tool_calls[].id` -> (1-based position, function name); first occurrence wins."""
    positions: dict[str, tuple[int, Any]] = {}
    if not isinstance(tool_calls, list):
        return positions
    for position, call in enumerate(tool_calls, start=1):
        if not isinstance(call, Mapping) or call.get("id") is None:
            continue
        function = call.get("function")
        name = function.get("name") if isinstance(function, Mapping) else call.get("name")
        positions.setdefault(str(call["id"]), (position, name))
    return positions


def repair_tool_results(messages: Sequence[Any]) -> list[Any]:
    """Put each run of tool results into the order of the calls they answer, named like the call.

    A run of consecutive `tool` messages is matched by `tool_call_id` (or `id`) to the most recent
    assistant turn's `tool_calls[].id` (ids are opaque strings). If every message of the run
    matches, the run is sorted by call position and each message's `tool` (and `name`, when it
    has one) is set to the call's function name; otherwise the run is left as it is.
    Copy-on-write: input messages are never modified. Idempotent.
    """
    out: list[Any] = []
    positions: dict[str, tuple[int, Any]] = {}
    i, n = 0, len(messages)
    while i < n:
        message = messages[i]
        role = message.get("role") if isinstance(message, Mapping) else None
        if role != "tool":
            if role == "assistant":
                positions = _call_positions(message.get("tool_calls")) if message.get("tool_calls") else {}
            out.append(message)
            i += 1
            continue
        run: list[tuple[int, int, Any, Any]] = []
        complete = True
        while i < n and isinstance(messages[i], Mapping) and messages[i].get("role") == "tool":
            result = messages[i]
            call_id = result.get("tool_call_id", result.get("id"))
            match = positions.get(str(call_id)) if call_id is not None else None
            if match is None:
                complete = False
                match = (0, None)
            run.append((match[0], len(run), result, match[1]))
            i += 1
        if not complete:
            out.extend(item[2] for item in run)
            continue
        for _, _, result, name in sorted(run, key=lambda item: (item[0], item[1])):
            if name is None:
                out.append(result)
                continue
            fixed = dict(result)
            fixed["tool"] = name
            if "name" in fixed:
                fixed["name"] = name
            out.append(fixed)
    return out


# ---------------------------------------------------------------------------------------------
# Segment builder


_OPEN_SEGMENT = Segment(OPEN, True)
_SEP_SEGMENT = Segment(SEP, True)
_CLOSE_SEGMENT = Segment(CLOSE, True)
_END_OF_MSG_SEGMENT = Segment(END_OF_MSG, True)
_EQUALS_QUOTE = Segment('="', False)
_QUOTE = Segment('"', False)
# Tag names and attribute keys come from this module only, so caching their segments is bounded.
_WORDS: dict[str, Segment] = {}
_CLOSE_TAGS: dict[str, tuple[Segment, ...]] = {}


def _word(text: str) -> Segment:
    segment = _WORDS.get(text)
    if segment is None:
        segment = _WORDS[text] = Segment(text, False)
    return segment


@functools.lru_cache(maxsize=4096)
def _open_tag(tag: str, attrs: tuple[tuple[str, str], ...]) -> tuple[Segment, ...]:
    """`<|open|>tag key="value"...<|sep|>` as segments (values already escaped); headers repeat a lot."""
    segments = [_OPEN_SEGMENT, _word(tag)]
    for key, value in attrs:
        segments += [_word(f" {key}"), _EQUALS_QUOTE] + ([Segment(value, False)] if value else []) + [_QUOTE]
    segments.append(_SEP_SEGMENT)
    return tuple(segments)


class _Builder:
    """Collects segments; drops empty ones, as the release does.

    Fixed pieces (markers, tag names, ` key`, `="`) are shared immutable segments: a 200-message
    agentic chat is ~10k segments and creating each one anew dominated render time.
    """

    def __init__(self, image_prompts: Sequence[str] | None):
        self.segments: list[Segment] = []
        self.image_prompts = image_prompts
        self.images_used = 0

    def text(self, text: Any) -> None:
        if text.__class__ is not str:
            text = str(text)
        if text:
            self.segments.append(Segment(text, False))

    def open(self, tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> None:
        escaped = tuple((key, escape_attr(value)) for key, value in attrs)
        # Only short headers go through the cache, so caller-sized values cannot pin memory.
        build = _open_tag if sum(len(value) for _, value in escaped) <= 256 else _open_tag.__wrapped__
        self.segments.extend(build(tag, escaped))

    def close(self, tag: str) -> None:
        segments = _CLOSE_TAGS.get(tag)
        if segments is None:
            segments = _CLOSE_TAGS[tag] = (_CLOSE_SEGMENT, _word(tag), _SEP_SEGMENT)
        self.segments.extend(segments)

    def end_of_msg(self) -> None:
        self.segments.append(_END_OF_MSG_SEGMENT)

    def image(self, where: str) -> None:
        if self.image_prompts is None:
            raise ChatError(f"{where} is an image but no image_prompts were given")
        if self.images_used >= len(self.image_prompts):
            raise ChatError(f"{where} is image #{self.images_used + 1} but only "
                            f"{len(self.image_prompts)} image_prompts were given")
        prompt = self.image_prompts[self.images_used]
        if not isinstance(prompt, str) or not prompt:
            raise ChatError(f"image_prompts[{self.images_used}] must be a non-empty string")
        self.segments.append(Segment(prompt, True))
        self.images_used += 1

    def content(self, content: Any, where: str) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, list):
            raise ChatError(f"{where} must be a string, a list of parts or null, got {type(content).__name__}")
        for k, part in enumerate(content):
            part_where = f"{where}[{k}]"
            if not isinstance(part, Mapping) or "type" not in part:
                raise ChatError(f"{part_where} must be an object with a 'type'")
            if part["type"] in ("image", "image_url"):
                self.image(part_where)
            elif isinstance(part.get("text"), str):
                self.text(part["text"])
            else:
                raise ChatError(f"{part_where}.text must be a string (part type {part['type']!r})")

    def system(self, message_type: str, body: str) -> None:
        self.open("message", [("role", "system"), ("type", message_type)])
        self.text(body.strip())
        self.close("message")
        self.end_of_msg()

    def tool_declare(self, tools: Any, where: str, dynamic: bool = False) -> None:
        template = _DYNAMIC_TOOL_DECLARE if dynamic else _TOOL_DECLARE
        self.open("message", [("role", "system"), ("type", "tool-declare")])
        self.text(template.format(_sorted_json(tools, where)))
        self.close("message")
        self.end_of_msg()


# ---------------------------------------------------------------------------------------------
# Tool calls


class _Call(NamedTuple):
    name: Any
    arguments: dict[str, Any]
    raw_json: str | None  # arguments string that is not JSON: rendered whole in a `json` element


def _parse_call(call: Any, where: str) -> _Call:
    if not isinstance(call, Mapping):
        raise ChatError(f"{where} must be an object")
    function = call.get("function", call)
    if not isinstance(function, Mapping):
        raise ChatError(f"{where}.function must be an object")
    fwhere = f"{where}.function" if "function" in call else where
    if "name" not in function:
        raise ChatError(f"{fwhere}.name is missing")
    arguments = function.get("arguments")
    if arguments is None:
        return _Call(function["name"], {}, None)
    if isinstance(arguments, Mapping):
        return _Call(function["name"], dict(arguments), None)
    if isinstance(arguments, str):
        if not arguments.strip():
            return _Call(function["name"], {}, None)
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return _Call(function["name"], {}, arguments)
        if not isinstance(parsed, dict):
            raise ChatError(f"{fwhere}.arguments must be a JSON object, got JSON {type(parsed).__name__}")
        return _Call(function["name"], parsed, None)
    raise ChatError(f"{fwhere}.arguments must be an object or a JSON object string, got {type(arguments).__name__}")


def _render_assistant(b: _Builder, message: Mapping[str, Any], where: str, thinking: bool) -> list[_Call]:
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        b.open("think")
        if reasoning is not None and str(reasoning).strip():
            b.text(reasoning)
        b.close("think")
    b.open("response")
    b.content(message.get("content"), f"{where}.content")
    b.close("response")
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        return []
    if not isinstance(tool_calls, list):
        raise ChatError(f"{where}.tool_calls must be a list")
    calls = [_parse_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(tool_calls)]
    b.open("tools")
    for index, call in enumerate(calls, start=1):
        b.open("call", [("tool", call.name), ("index", index)])
        if call.raw_json is not None:
            b.open("json", [("type", "object")])
            b.text(call.raw_json)
            b.close("json")
        else:
            for key, value in call.arguments.items():
                b.open("argument", [("key", key), ("type", argument_type(value))])
                b.text(_argument_text(value, f"{where}.tool_calls[{index - 1}] argument {key!r}"))
                b.close("argument")
        b.close("call")
    b.close("tools")
    return calls


# ---------------------------------------------------------------------------------------------
# Options


def _resolve_thinking(thinking: Any, enable_thinking: Any, reasoning_effort: Any,
                      thinking_effort: Any) -> tuple[bool, str | None]:
    if thinking is None:
        thinking = True if enable_thinking is None else enable_thinking
    if not isinstance(thinking, bool):
        raise ChatError(f"thinking must be true or false, got {thinking!r}")
    if reasoning_effort is not None and reasoning_effort != "none" and reasoning_effort not in THINKING_EFFORTS:
        raise ChatError(f"reasoning_effort must be one of none, {', '.join(THINKING_EFFORTS)}; "
                        f"got {reasoning_effort!r}")
    if reasoning_effort == "none":
        thinking = False
    elif reasoning_effort is not None and thinking_effort in (_UNSET, None):
        thinking_effort = reasoning_effort  # the OpenAI name fills in an unset thinking_effort
    if thinking_effort is _UNSET:
        thinking_effort = DEFAULT_THINKING_EFFORT
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ChatError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)} (or null for no effort "
                        f"message); got {thinking_effort!r}")
    return thinking, thinking_effort


def _response_schema(response_format: Any) -> Any:
    """The schema a `json_schema` response format names (OpenAI's nesting, or a bare schema)."""
    if not isinstance(response_format, Mapping):
        return None
    json_schema = response_format.get("json_schema")
    if isinstance(json_schema, Mapping):
        return json_schema.get("schema", json_schema.get("json_schema", json_schema))
    return json_schema


def _response_format_type(response_format: Any) -> Any:
    if response_format is None or isinstance(response_format, str):
        return response_format
    if isinstance(response_format, Mapping):
        return response_format.get("type", response_format)
    raise ChatError(f"response_format must be an object or a string, got {type(response_format).__name__}")


# ---------------------------------------------------------------------------------------------
# Public entry points


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool | None = None,
    enable_thinking: bool | None = None,
    reasoning_effort: str | None = None,
    thinking_effort: str | None = _UNSET,
    tool_choice: Any = None,
    response_format: Any = None,
    response_schema: Any = _UNSET,
    image_prompts: Sequence[str] | None = None,
    **unknown: Any,
) -> list[Segment]:
    """Render a chat into segments (see the module docstring for the rules).

    `thinking_effort` defaults to "max" (the release's `apply_chat_template`); pass None for no
    effort message (its lower-level `build_chat_segments`). `reasoning_effort` is the OpenAI name
    ("none" turns thinking off). `image_prompts[i]` replaces the i-th `image`/`image_url` content
    part, as one special-allowed segment; their numbers must match.
    """
    check_chat_kwargs(unknown)
    if not isinstance(messages, list | tuple):
        raise ChatError(f"messages must be a list, got {type(messages).__name__}")
    if not isinstance(add_generation_prompt, bool):
        raise ChatError(f"add_generation_prompt must be true or false, got {add_generation_prompt!r}")
    if image_prompts is not None and not isinstance(image_prompts, list | tuple):
        raise ChatError("image_prompts must be a list of strings")
    if tool_choice is not None and not isinstance(tool_choice, Mapping) and tool_choice not in TOOL_CHOICES:
        raise ChatError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or an object; got {tool_choice!r}")
    thinking, thinking_effort = _resolve_thinking(thinking, enable_thinking, reasoning_effort, thinking_effort)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if "role" not in message:
            raise ChatError(f"messages[{i}].role is missing")
    if response_schema is _UNSET:
        response_schema = _response_schema(response_format)
    format_type = _response_format_type(response_format)

    b = _Builder(image_prompts)
    if tools:
        b.tool_declare(tools, "tools")
    if thinking and thinking_effort is not None:
        b.system("thinking-effort", _THINKING_EFFORT.format(thinking_effort))

    calls: list[_Call] = []
    tool_index = 0
    # Repair only permutes runs of tool results, so positions in errors still point at the input.
    for i, message in enumerate(repair_tool_results(list(messages))):
        where = f"messages[{i}]"
        role = message["role"]
        name = message.get("name")
        if role in ("user", "system"):
            if role == "system" and message.get("tools"):
                b.tool_declare(message["tools"], f"{where}.tools", dynamic=True)
                continue
            b.open("message", [("role", role)] + ([("name", name)] if name else []))
            b.content(message.get("content"), f"{where}.content")
        elif role == "tool":
            tool_index += 1
            tool_name = message.get("tool", name)
            if tool_name is None and tool_index <= len(calls):
                tool_name = calls[tool_index - 1].name
            if tool_name is None:
                raise ChatError(f"{where} (role tool) needs a tool name: give 'tool' or 'name', a 'tool_call_id' "
                                "matching the previous assistant turn, or follow that turn's calls in order")
            b.open("message", [("role", "tool"), ("tool", tool_name), ("index", tool_index)])
            b.content(message.get("content"), f"{where}.content")
        elif role == "assistant":
            tool_index = 0
            b.open("message", [("role", "assistant")] + ([("name", name)] if name else []))
            calls = _render_assistant(b, message, where, thinking)
        else:
            raise ChatError(f"{where}.role must be system, user, assistant or tool; got {role!r}")
        b.close("message")
        b.end_of_msg()

    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE:
        b.system("tool-choice", _TOOL_CHOICE[tool_choice])
    if format_type == "json_object":
        b.system("response-format", _JSON_OBJECT)
    elif format_type == "json_schema":
        b.system("response-format", _JSON_SCHEMA.format(_sorted_json(response_schema, "response schema")))

    if add_generation_prompt:
        b.open("message", [("role", "assistant")])
        b.open("think" if thinking else "response")

    if image_prompts is not None and b.images_used != len(image_prompts):
        raise ChatError(f"{len(image_prompts)} image_prompts were given but the messages hold {b.images_used} images")
    return b.segments


# The chat-template keyword arguments a request may set: `render`'s keyword options, bar
# `image_prompts` (the caller's own: the prompts of the images it embedded). Read from the
# signature, so the list and what `render` takes cannot drift apart.
CHAT_KWARGS: tuple[str, ...] = tuple(
    name for name, parameter in inspect.signature(render).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "image_prompts")


def check_chat_kwargs(names: Iterable[str]) -> None:
    """Refuse any name that is not one of `CHAT_KWARGS` (a `ChatError` naming it and the allowed ones)."""
    unknown = sorted(set(names) - set(CHAT_KWARGS))
    if unknown:
        raise ChatError(f"unknown chat option(s) {unknown}; allowed: {list(CHAT_KWARGS)}")


def render_text(messages: Sequence[Mapping[str, Any]], tools: Any = None, **kwargs: Any) -> str:
    return "".join(segment.text for segment in render(messages, tools, **kwargs))


def render_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], tools: Any = None,
               **kwargs: Any) -> Prompt:
    """The rendered prompt as text and as token ids (segment-wise encoded)."""
    segments = render(messages, tools, **kwargs)
    return Prompt("".join(segment.text for segment in segments), tokenizer.encode_segments(segments))
