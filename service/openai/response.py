"""Engine results -> OpenAI chat-completions objects, in vLLM's shape.

`Reply` gathers what `Engine.generate` yields into one assistant message: the content, the
reasoning text (in `reasoning`, the field vLLM's OpenAI server uses for it), tool calls, the finish
reason and the usage (prompt tokens after media_pad expansion). `completion` makes the
`chat.completion` body; `chunk` one `chat.completion.chunk` of a stream (`Reply.add` gives the
delta of each item); `error_body` the error object, with the status the error taxonomy gives.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.engine import GenerationResult
from service.errors import Failure, Kind
from textcore import parser as p

# OpenAI's error `type` for each kind (the HTTP status is the taxonomy's).
ERROR_TYPES = {
    Kind.BAD_INPUT: "invalid_request_error",
    Kind.TOO_LARGE: "invalid_request_error",
    Kind.UNSUPPORTED: "invalid_request_error",
    Kind.NOT_CONFIGURED: "invalid_request_error",
    Kind.NOT_FOUND: "invalid_request_error",
    Kind.UNAUTHENTICATED: "authentication_error",
    Kind.OVERLOADED: "rate_limit_error",
    Kind.UNAVAILABLE: "service_unavailable_error",
    Kind.DEADLINE: "timeout_error",
    Kind.CANCELLED: "cancelled_error",
    Kind.INTERNAL: "server_error",
}


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    result: GenerationResult | None = None

    def add(self, item: p.Event | GenerationResult) -> dict[str, Any] | None:
        """Take one item of `Engine.generate`; return its streaming delta (None: nothing to send)."""
        if isinstance(item, GenerationResult):
            self.result = item
            return None
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

    @property
    def finish_reason(self) -> str:
        assert self.result is not None, "the generation has not finished"
        if self.result.finish_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return self.result.finish_reason

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content,
                               "reasoning": self.reasoning or None}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def usage(self) -> dict[str, int]:
        assert self.result is not None, "the generation has not finished"
        r = self.result
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens}


def completion(reply: Reply, *, model: str, request_id: str, created: int | None = None) -> dict[str, Any]:
    """A `chat.completion` object."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": reply.message(), "logprobs": None, "finish_reason": reply.finish_reason}],
        "usage": reply.usage(),
    }


def chunk(delta: dict[str, Any] | None, *, model: str, request_id: str, created: int,
          finish_reason: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk` object (no choice at all when `delta` is None: the usage chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    out: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def error_body(failure: Failure) -> dict[str, Any]:
    """The OpenAI error object; `code` is the HTTP status (as vLLM's server sends it)."""
    return error_object(failure.message, ERROR_TYPES[failure.kind], failure.rule.http)


def error_object(message: str, error_type: str, status: int) -> dict[str, Any]:
    """The OpenAI error object for a status of HTTP itself (404, 405, 408, 431), which no kind of
    the taxonomy stands for."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}
