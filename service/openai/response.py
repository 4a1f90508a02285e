"""Engine results -> OpenAI chat-completions and completions objects, in vLLM's shape.

`Reply` gathers what `Engine.generate` yields for one request: one `ChoiceReply` per choice (its
content, the reasoning text in `reasoning`, the field vLLM's OpenAI server uses for it, tool calls,
the `logprobs.content` entries when asked for, the finish reason) and the usage (prompt tokens after
media_pad expansion, once; completion tokens of all choices). `completion` makes the
`chat.completion` body; `chunk` one `chat.completion.chunk` of a stream (`Reply.add` gives the
chunk's choice for each item); `error_body` the error object, with the status the error taxonomy
gives. `CompletionReply` is the same for `/v1/completions` (`text_completion`): one choice per
prompt and n (index `prompt * n + i`, as vLLM's), its text (after its prompt's with `echo`) and
its logprobs in OpenAI's completions shape (`tokens`, `token_logprobs`, `top_logprobs` holding the
chosen token and the most likely ones, `text_offset`), and vLLM's `stop_reason` (the stop string or
stop token id that ended it; null for <|end_of_msg|> or the length). `TokenCounts` is a stream's usage so far
(vLLM's `continuous_usage_stats`).
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
          usage: dict[str, int] | None = None, kind: str = "chat.completion.chunk") -> dict[str, Any]:
    """A `chat.completion.chunk` object, or a streamed `text_completion` (`kind`); no choice at
    all: the usage chunk."""
    out: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


@dataclass
class TokenCounts:
    """A request's usage while it streams: its prompts' tokens, and each output token as the
    engine reports it (`add`, the `counted` of `Engine.generate`)."""

    prompt: int
    completion: int = 0

    def add(self, _index: int) -> None:
        self.completion += 1

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion}


@dataclass
class CompletionChoiceReply:
    """One completion choice: its text, its tokens' logprobs when asked for, its result."""

    index: int
    text: str = ""
    logprobs: dict[str, list[Any]] | None = None
    result: GenerationResult | None = None
    _offset: int = 0  # the next token's text_offset
    _unsent: int = 0  # logprobs entries not yet in a chunk

    def add(self, item: p.Event | Logprobs | GenerationResult) -> dict[str, Any] | None:
        """Take one item; return its streaming choice, or None (nothing to send yet)."""
        if isinstance(item, Logprobs):
            self._add_logprobs(item)
            return None
        if isinstance(item, GenerationResult):
            self.result = item
            return self._part("", item.finish_reason)
        if isinstance(item, p.ContentDelta):
            self.text += item.text
            return self._part(item.text, None)
        return None  # a completion's decoder writes nothing else

    def _add_logprobs(self, item: Logprobs) -> None:
        if self.logprobs is None:
            self.logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        token, _ = item.text(item.chosen)
        top = {token: max(item.chosen.logprob, LOGPROB_FLOOR)}
        for entry in item.top:
            top.setdefault(item.text(entry)[0], max(entry.logprob, LOGPROB_FLOOR))
        for key, value in (("text_offset", self._offset), ("token_logprobs", top[token]), ("tokens", token),
                           ("top_logprobs", top)):
            self.logprobs[key].append(value)
        self._offset += len(token)
        self._unsent += 1

    def _part(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            logprobs = {key: values[len(values) - self._unsent:] for key, values in self.logprobs.items()}
            self._unsent = 0
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": self.result.stop_reason if finish_reason else None}

    def as_choice(self) -> dict[str, Any]:
        assert self.result is not None, "the choice has not finished"
        return {"index": self.index, "text": self.text, "logprobs": self.logprobs,
                "finish_reason": self.result.finish_reason, "stop_reason": self.result.stop_reason}


@dataclass
class CompletionReply:
    """All choices of one completions request: `prompts` prompts, `n` choices each; with `echoes`,
    each choice's text begins with its prompt's."""

    prompts: int
    n: int
    echoes: list[str] | None = None
    choices: dict[int, CompletionChoiceReply] = field(default_factory=dict)

    def choice(self, prompt: int, index: int) -> tuple[CompletionChoiceReply, bool]:
        """The choice of reply `index` of prompt `prompt`, and whether it is new."""
        at = prompt * self.n + index
        if at in self.choices:
            return self.choices[at], False
        self.choices[at] = CompletionChoiceReply(at, self.echoes[prompt] if self.echoes else "")
        return self.choices[at], True

    def usage(self) -> dict[str, int]:
        assert len(self.choices) == self.prompts * self.n and all(c.result for c in self.choices.values()), \
            "the generation has not finished"
        prompt = sum(self.choices[k * self.n].result.prompt_tokens for k in range(self.prompts))
        completion_tokens = sum(c.result.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}


def text_completion(reply: CompletionReply, *, model: str, request_id: str) -> dict[str, Any]:
    """A `text_completion` object, its choices indexed 0..prompts*n-1."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [reply.choices[i].as_choice() for i in sorted(reply.choices)], "usage": reply.usage()}


def error_body(failure: Failure) -> dict[str, Any]:
    """The OpenAI error object: its `type` is the kind's (`service.errors.RULES`), `code` the HTTP
    status (as vLLM's server sends it)."""
    return {"error": {"message": failure.message, "type": failure.rule.openai_type, "param": None,
                      "code": failure.rule.http}}
