"""Streaming parser for Kimi-K3 output: token ids in, typed events out.

The model continues the generation prompt (`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`,
or `...<|open|>response<|sep|>` without thinking) with the rest of an assistant turn:

    reasoning<|close|>think<|sep|><|open|>response<|sep|>content<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="bash" index="1"<|sep|>
      <|open|>argument key="command" type="string"<|sep|>ls<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

The parser is a state machine over ids, so a marker is recognised only as its control id, never
from text (a model writing the characters `<|open|>` inside an argument is just text). A call is
announced (`ToolCallStart`) as soon as its header ends, before any argument byte; argument text
streams with its key and type; each argument is parsed on its own when it closes, so a bad value
yields a `ToolArgumentError` and leaves its siblings intact. Generation stops at `<|end_of_msg|>`.

Feeding any split of the same ids gives the same `finish()` result and, once consecutive deltas
of the same kind are merged, the same events.

A completion (`/v1/completions`) continues any text, not an assistant turn: its ids go to a
`TextDecoder` instead, which has no grammar and writes every token's text (`output_parser` picks).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from textcore.tokenizer import CLOSE_ID, END_OF_MSG_ID, NUM_BASE_TOKENS, OPEN_ID, SEP_ID, Tokenizer


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolArgumentDelta:
    """Raw text of one argument as it streams. `key` is None for a whole-arguments `json` block."""

    index: int
    key: str | None
    type: str
    text: str


@dataclass(frozen=True)
class ToolArgumentDone:
    index: int
    key: str | None
    type: str
    value: Any


@dataclass(frozen=True)
class ToolArgumentError:
    """One argument that could not be parsed; the call's other arguments are unaffected."""

    index: int
    key: str | None
    type: str
    raw: str
    message: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ProtocolError:
    """Output that does not follow the K3 grammar (e.g. an unknown element or a stray marker)."""

    message: str


@dataclass(frozen=True)
class Stop:
    token_id: int


Event = (ReasoningDelta | ContentDelta | ToolCallStart | ToolArgumentDelta | ToolArgumentDone | ToolArgumentError
         | ToolCallEnd | ProtocolError | Stop)

_HEADER = re.compile(r'\s*([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*')
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')
_ENTITY = re.compile(r"&(amp|quot);")
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "number": (int, float), "boolean": bool, "null": type(None), "object": dict, "array": list}


def unescape_attr(value: str) -> str:
    return _ENTITY.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def parse_argument(type_name: str, raw: str) -> Any:
    """The value of a rendered argument: strings verbatim, every other type as JSON of that type."""
    if type_name == "string":
        return raw
    if type_name not in _JSON_TYPES:
        raise ValueError(f"unknown argument type {type_name!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON for type {type_name}: {exc.msg} at char {exc.pos}") from None
    expected = _JSON_TYPES[type_name]
    if not isinstance(value, expected) or (type_name == "number" and isinstance(value, bool)):
        raise ValueError(f"JSON {type(value).__name__} where type {type_name} was declared")
    return value


@dataclass
class _Call:
    index: int
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "index": self.index, "arguments": self.arguments, "errors": self.errors}


@dataclass
class _Element:
    tag: str
    call: _Call | None = None  # set for call, argument and json elements
    key: str | None = None  # argument key
    type: str = ""  # argument type ("object" for a json block)
    raw: list[str] = field(default_factory=list)  # argument text so far


_TEXT, _OPEN_HEADER, _CLOSE_HEADER, _DONE = range(4)
# The elements a model may open inside each element of an assistant turn.
_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}


class _Spacing:
    """vLLM's `spaces_between_special_tokens` (its slow tokenizers' decoding): a control token written
    as text is a piece of its own, and it is set apart from the text (or token) beside it by a space."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.started = False  # some text was written
        self.after_special = False

    def text(self, text: str) -> str:
        out = " " + text if self.on and self.after_special else text
        self.started, self.after_special = True, False
        return out

    def special(self, name: str) -> str:
        out = " " + name if self.on and self.started else name
        self.started = self.after_special = True
        return out


class StreamParser:
    """Incremental parser of one assistant turn's token ids (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool = True, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        """`skip_special_tokens` False: a control token that is not structure (e.g. a stray
        `<|media_pad|>` in text) is written into the text as its name instead of being dropped with a
        `ProtocolError` (vLLM's skip_special_tokens; the markers of the grammar are never text), set
        apart by spaces unless `spaces_between_special_tokens` is False."""
        self._tokenizer = tokenizer
        self._special_text = not skip_special_tokens
        self._spacing = _Spacing(spaces_between_special_tokens)
        self._stack = [_Element("message"), _Element("think" if thinking else "response")]
        self._mode = _TEXT
        self._text_ids: list[int] = []
        self._header_ids: list[int] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stray: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._events: list[Event] = []
        self._stopped = False
        self._ignored_after_stop = 0
        self._closed = False

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, ids: Iterable[int]) -> list[Event]:
        """Consume more ids; return the events they complete."""
        if self._closed:
            raise RuntimeError("feed() after finish()")
        for token_id in ids:
            if self._mode == _DONE:
                if self._ignored_after_stop == 0:
                    self._error("tokens after <|end_of_msg|> are ignored")
                self._ignored_after_stop += 1
            elif token_id < NUM_BASE_TOKENS:
                (self._text_ids if self._mode == _TEXT else self._header_ids).append(token_id)
            elif self._mode == _TEXT:
                self._control_in_text(token_id)
            else:
                self._control_in_header(token_id)
        self._flush_text(final=False)
        return self._take_events()

    def _control_in_text(self, token_id: int) -> None:
        if token_id in (OPEN_ID, CLOSE_ID):
            self._end_text()
            self._mode = _OPEN_HEADER if token_id == OPEN_ID else _CLOSE_HEADER
            self._header_ids = []
        elif token_id == END_OF_MSG_ID:
            self._stop(token_id)
        else:
            self._tokenizer.decode_bytes([token_id])  # rejects ids outside the vocabulary
            if self._special_text:
                self._flush_text(final=False)
                self._emit_text(self._spacing.special(self._name(token_id)))
            else:
                self._error(f"unexpected control token {self._name(token_id)} in text")

    def _control_in_header(self, token_id: int) -> None:
        if token_id == SEP_ID:
            header = self._tokenizer.decode_bytes(self._header_ids).decode("utf-8", errors="replace")
            if self._mode == _OPEN_HEADER:
                self._open(header)
            else:
                self._close(header.strip())
            self._mode = _TEXT
            return
        kind = "<|open|>" if self._mode == _OPEN_HEADER else "<|close|>"
        self._error(f"{kind} header not ended by <|sep|> before {self._name(token_id)}")
        self._mode = _TEXT
        self._control_in_text(token_id)

    def _stop(self, token_id: int) -> None:
        self._end_text()
        self._settle_open_calls()
        self._mode = _DONE
        self._stopped = True
        self._events.append(Stop(token_id))

    def _name(self, token_id: int) -> str:
        return self._tokenizer.special_names.get(token_id, str(token_id))

    # -- text ---------------------------------------------------------------------------------

    def _flush_text(self, final: bool) -> None:
        data = self._tokenizer.decode_bytes(self._text_ids) if self._text_ids else b""
        self._text_ids = []
        if not data and not final:
            return
        text = self._decoder.decode(data, final=final)
        if text:
            self._emit_text(self._spacing.text(text))

    def _end_text(self) -> None:
        """A marker ends the current text run: finish its characters and report stray text."""
        self._flush_text(final=True)
        self._decoder.reset()
        stray = "".join(self._stray)
        self._stray = []
        if stray.strip():
            where = self._stack[-1].tag if self._stack else "the message"
            self._error(f"text outside any text element (inside {where}): {stray[:80]!r}")

    def _emit_text(self, text: str) -> None:
        top = self._stack[-1] if self._stack else None
        tag = top.tag if top else None
        if tag == "think" and len(self._stack) == 2:
            self._reasoning.append(text)
            self._events.append(ReasoningDelta(text))
        elif tag == "response" and len(self._stack) == 2:
            self._content.append(text)
            self._events.append(ContentDelta(text))
        elif tag in ("argument", "json") and top.call is not None:
            top.raw.append(text)
            self._events.append(ToolArgumentDelta(top.call.index, top.key, top.type, text))
        else:
            self._stray.append(text)

    # -- structure ----------------------------------------------------------------------------

    def _open(self, header: str) -> None:
        match = _HEADER.fullmatch(header)
        if match is None:
            self._error(f"malformed element header {header[:80]!r}")
            self._stack.append(_Element("?"))
            return
        tag = match.group(1)
        attrs = {key: unescape_attr(value) for key, value in _ATTR.findall(match.group(2))}
        parent = self._stack[-1].tag if self._stack else None
        if tag not in _CHILDREN.get(parent or "", ()):
            self._error(f"element {tag!r} is not expected inside {parent or 'nothing (the message is closed)'}")
            self._stack.append(_Element(tag))
            return
        if tag == "call":
            self._open_call(attrs)
        elif tag in ("argument", "json"):
            call = self._stack[-1].call
            key = attrs.get("key") if tag == "argument" else None
            type_name = attrs.get("type", "object" if tag == "json" else "")
            element = _Element(tag, call=call, key=key, type=type_name)
            self._stack.append(element)
            if tag == "argument" and key is None and call is not None:
                call.errors.append({"key": None, "type": type_name, "raw": "", "message": "argument without a key"})
        else:
            self._stack.append(_Element(tag))

    def _open_call(self, attrs: dict[str, str]) -> None:
        position = len(self._calls) + 1
        index_text = attrs.get("index", "")
        index = int(index_text) if index_text.isdigit() else position
        if not index_text.isdigit():
            self._error(f"call #{position} has index {index_text!r}; using its position {position}")
        name = attrs.get("tool")
        if not name:
            self._error(f"call #{position} has no tool name")
            name = ""
        call = _Call(index, name)
        self._calls.append(call)
        self._stack.append(_Element("call", call=call))
        self._events.append(ToolCallStart(index, name))

    def _close(self, tag: str) -> None:
        if not any(element.tag == tag for element in self._stack):
            self._error(f"<|close|>{tag} closes no open element")
            return
        while self._stack:
            element = self._stack.pop()
            if element.tag == tag:
                self._finish_element(element, complete=True)
                return
            self._error(f"element {element.tag!r} was not closed before {tag!r}")
            self._finish_element(element, complete=False)

    def _finish_element(self, element: _Element, complete: bool) -> None:
        call = element.call
        if call is None:
            return
        if element.tag == "call":
            if not complete:
                call.errors.append({"key": None, "type": "", "raw": "", "message": "the call was not closed"})
            self._events.append(ToolCallEnd(call.index, call.name, dict(call.arguments)))
            return
        raw = "".join(element.raw)
        if element.tag == "argument" and element.key is None:
            return  # already reported when it opened
        try:
            if not complete:
                raise ValueError("the argument was not closed")
            value = parse_argument(element.type, raw)
            if element.tag == "json" and not isinstance(value, dict):
                raise ValueError("a json arguments block must hold an object")
            if element.tag == "argument" and element.key in call.arguments:
                raise ValueError("duplicate argument key")
        except ValueError as exc:
            error = ToolArgumentError(call.index, element.key, element.type, raw, str(exc))
            call.errors.append({"key": element.key, "type": element.type, "raw": raw, "message": str(exc)})
            self._events.append(error)
            return
        if element.tag == "json":
            call.arguments.update(value)
        else:
            call.arguments[element.key] = value
        self._events.append(ToolArgumentDone(call.index, element.key, element.type, value))

    def _settle_open_calls(self) -> None:
        """The turn ended inside a call: report its open argument and end the call (innermost first)."""
        while self._stack and self._stack[-1].call is not None:
            self._finish_element(self._stack.pop(), complete=False)

    def _error(self, message: str) -> None:
        self._events.append(ProtocolError(message))

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> list[Event]:
        """End of the stream: flush the last characters and settle unterminated elements."""
        if self._closed:
            return []
        if self._mode != _DONE:
            if self._mode != _TEXT:
                self._error("output ended inside an element header")
            self._end_text()
            self._settle_open_calls()
        self._closed = True
        return self._take_events()

    def finish(self) -> dict[str, Any]:
        """The parsed turn: `reasoning_content`, `content`, `tool_calls` (`name`, `index`, `arguments`,
        `errors`) and `stopped` (whether `<|end_of_msg|>` was generated)."""
        self.close()
        return {
            "reasoning_content": "".join(self._reasoning),
            "content": "".join(self._content),
            "tool_calls": [call.as_dict() for call in self._calls],
            "stopped": self._stopped,
        }


class TextDecoder:
    """A completion's output ids as `ContentDelta` events of the text they decode to, incrementally
    (a character split over tokens comes whole). A control token flagged special is dropped with
    `skip_special_tokens`; any other (and every one without it) is written as its name, spaced as
    `_Spacing` says. `<|end_of_msg|>` ends the text. The same `feed` / `close` as `StreamParser`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._spacing = _Spacing(spaces_between_special_tokens)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._done = False

    def feed(self, ids: Iterable[int]) -> list[Event]:
        events: list[Event] = []
        text_ids: list[int] = []
        for token_id in ids:
            if self._done:
                continue
            if token_id < NUM_BASE_TOKENS:
                text_ids.append(token_id)
                continue
            self._text(events, text_ids, final=True)
            text_ids = []
            name = self._tokenizer.special_names.get(token_id)
            if name is None:
                self._tokenizer.decode_bytes([token_id])  # raises: an id outside the vocabulary
            if token_id == END_OF_MSG_ID:
                self._done = True
            elif not (self._skip and token_id in self._tokenizer.skippable_ids):
                events.append(ContentDelta(self._spacing.special(name)))
        self._text(events, text_ids, final=False)
        return events

    def _text(self, events: list[Event], ids: list[int], *, final: bool) -> None:
        data = self._tokenizer.decode_bytes(ids) if ids else b""
        text = self._decoder.decode(data, final=final)
        if final:
            self._decoder.reset()
        if text:
            events.append(ContentDelta(self._spacing.text(text)))

    def close(self) -> list[Event]:
        events: list[Event] = []
        self._text(events, [], final=True)
        return events


def output_parser(tokenizer: Tokenizer, *, turn: bool, thinking: bool, skip_special_tokens: bool,
                  spaces_between_special_tokens: bool) -> StreamParser | TextDecoder:
    """What reads a reply's ids: an assistant turn's parser (`turn`), else a completion's decoder."""
    if turn:
        return StreamParser(tokenizer, thinking=thinking, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)
    return TextDecoder(tokenizer, skip_special_tokens=skip_special_tokens,
                       spaces_between_special_tokens=spaces_between_special_tokens)
