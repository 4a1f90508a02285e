"""Engine results -> OpenAI chat-completions objects, in vLLM's shape.

`Reply` gathers what `Engine.generate` yields for one request: one `ChoiceReply` per choice (its
content, the reasoning text in `reasoning`, the field vLLM's OpenAI server uses for it, tool calls,
the `logprobs.content` entries when asked for, the finish reason) and the usage (prompt tokens after
media_pad expansion, once; completion tokens of all choices). `completion` makes the
`chat.completion` body; `chunk` one `chat.completion.chunk` of a stream (`Reply.add` gives the
chunk's choice for each item); `error_body` the error object, with the status the error taxonomy
gives.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.engine import Choice, GenerationResult, Logprobs, TokenLogprob
from service.errors import Failure
from textcore import parser as p

LOGPROB_FLOOR = -9999.0  # OpenAI's logprob for a token too unlikely to have one (JSON has no -inf)

def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _logprob(entry: TokenLogprob, logprobs: Logprobs) -> dict[str, Any]:
    token, data = logprobs.text(entry)  # here, not on the trunk's thread
    return {"token": token, "logprob": max(entry.logprob, LOGPROB_FLOOR), "bytes": list(data)}


def logprobs_entry(logprobs: Logprobs) -> dict[str, Any]:
    """One token of OpenAI's `choices[].logprobs.content`."""
    return {**_logprob(logprobs.chosen, logprobs), "top_logprobs": [_logprob(e, logprobs) for e in logprobs.top]}


@dataclass
class ChoiceReply:
    """One choice: what its items said, and its result."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None  # the `logprobs.content` entries, when asked for
    result: GenerationResult | None = None
    _unsent: list[dict[str, Any]] = field(default_factory=list)  # logprobs not yet in a chunk

    def add(self, item: p.Event | Logprobs | GenerationResult) -> dict[str, Any] | None:
        """Take one item; return its streaming choice (`index`, `delta`, `logprobs`, `finish_reason`)
        or None (nothing to send yet). A token's logprobs go out with the next chunk of its choice."""
        if isinstance(item, Logprobs):
            entry = logprobs_entry(item)
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(entry)
            self._unsent.append(entry)
            return None
        if isinstance(item, GenerationResult):
            self.result = item
            return self._part({}, self.finish_reason)
        delta = self._delta(item)
        return None if delta is None else self._part(delta, None)

    def _delta(self, item: p.Event) -> dict[str, Any] | None:
        if isinstance(item, p.ContentDelta):
            self.content += item.text
            return {"content": item.text}
        if isinstance(item, p.ReasoningDelta):
            self.reasoning += item.text
            return {"reasoning": item.text}
        if isinstance(item, p.ToolCallEnd):
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": item.name, "arguments": json.dumps(item.arguments, ensure_ascii=False)}}
            self.tool_calls.append(call)
            return {"tool_calls": [{"index": len(self.tool_calls) - 1, **call}]}
        return None  # tool-call progress (sent whole at its end), protocol errors, Stop

    def _part(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        sent, self._unsent = self._unsent, []
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs_object(sent),
                "finish_reason": finish_reason}

    def _logprobs_object(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None else {"content": entries or [], "refusal": None}

    @property
    def finish_reason(self) -> str:
        assert self.result is not None, "the choice has not finished"
        if self.result.finish_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return self.result.finish_reason

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content,
                               "reasoning": self.reasoning or None}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def as_choice(self) -> dict[str, Any]:
        """This choice in a `chat.completion`."""
        return {"index": self.index, "message": self.message(), "logprobs": self._logprobs_object(self.logprobs),
                "finish_reason": self.finish_reason}


@dataclass
class Reply:
    """All choices of one request, by index."""

    choices: dict[int, ChoiceReply] = field(default_factory=dict)

    def add(self, choice: Choice) -> dict[str, Any] | None:
        """Take one item of `Engine.generate`; return its streaming choice, or None."""
        if choice.index not in self.choices:
            self.choices[choice.index] = ChoiceReply(choice.index)
        return self.choices[choice.index].add(choice.item)

    @property
    def finished(self) -> bool:
        """Every choice has its result (a generation that ended early has none)."""
        return bool(self.choices) and all(c.result is not None for c in self.choices.values())

    def usage(self) -> dict[str, int]:
        assert self.finished, "the generation has not finished"
        results = [c.result for c in self.choices.values()]
        prompt, completion_tokens = results[0].prompt_tokens, sum(r.completion_tokens for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}


def completion(reply: Reply, *, model: str, request_id: str, created: int | None = None) -> dict[str, Any]:
    """A `chat.completion` object, its choices indexed 0..n-1."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [reply.choices[i].as_choice() for i in sorted(reply.choices)],
        "usage": reply.usage(),
    }


def chunk(choices: list[dict[str, Any]], *, model: str, request_id: str, created: int,
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk` object (no choice at all: the usage chunk)."""
    out: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def error_body(failure: Failure) -> dict[str, Any]:
    """The OpenAI error object: its `type` is the kind's (`service.errors.RULES`), `code` the HTTP
    status (as vLLM's server sends it)."""
    return {"error": {"message": failure.message, "type": failure.rule.openai_type, "param": None,
                      "code": failure.rule.http}}
