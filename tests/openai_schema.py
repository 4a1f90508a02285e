"""Pydantic models of the OpenAI chat-completions objects, written from the public API reference
(https://platform.openai.com/docs/api-reference/chat/object, .../chat/streaming): what the HTTP face
sends and what a batch row's body holds. Strict: a field the reference does not name is an error,
but for `reasoning`, the reasoning text in the field vLLM's OpenAI server uses for it, and vLLM's
`ec_transfer_params` on an EC producer's answer (`EncoderCompletion`). The logprobs objects
(`ChoiceLogprobs`, `TokenLogprob`, `TopLogprob`) follow the openai SDK's `ChoiceLogprobs` and
`chat_completion_token_logprob.py` field for field, stricter (every field present)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Model):
    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = None  # vLLM's field for the reasoning text
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Model):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class Choice(_Model):
    index: int
    message: Message
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Model):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class EncoderCompletion(ChatCompletion):
    """A vLLM EC producer's answer: what the encoder published, per key (vLLM's response field)."""

    ec_transfer_params: dict[str, Any]


class Delta(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None


class ChunkChoice(_Model):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter", "function_call"] | None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(_Model):
    error: ErrorInfo
