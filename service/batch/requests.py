"""What an input line asks for, checked: the OpenAI batch envelope (`method`, `url`, `body`), then by
its `url` a chat-completions body (read by `service.openai.request.parse_chat_request`, the parser
the HTTP face uses) or an embeddings body (one image, in vLLM's multimodal form: `messages`).

Every problem raises an error with a kind naming the field (`BadRequest`, `Unsupported`, a
sampling value's `SamplingError`); the runner makes it that line's error row. A line may leave out
`method` (POST) and `url` (the job's endpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from service.batch.inputs import CHAT_URL, EMBEDDINGS_URL, Item
from service.errors import BadRequest, Unsupported
from service.media import MediaRef
from service.openai.request import ChatRequest, parse_chat_request

LINE_FIELDS = ("custom_id", "method", "url", "body")
# An embeddings body: `messages` holds the image; `encoding_format` only as the shards store it.
EMBEDDING_FIELDS = ("model", "messages", "encoding_format", "user")


def _body(item: Item, task: str) -> Mapping[str, Any]:
    if item.problem is not None:
        raise BadRequest(item.problem)
    line = item.request
    assert line is not None
    unknown = sorted(set(line) - set(LINE_FIELDS))
    if unknown:
        raise Unsupported(f"unknown field(s) {unknown}; a line has {', '.join(LINE_FIELDS)} (OpenAI batch format)")
    method = line.get("method", "POST")
    if method != "POST":
        raise BadRequest(f"method must be POST, got {method!r}")
    endpoint = EMBEDDINGS_URL if task == "embed" else CHAT_URL
    url = line.get("url", endpoint)
    if url != endpoint:
        if url == EMBEDDINGS_URL:
            raise Unsupported(f"url {url}: this job generates text (--task {task}); embeddings need --task embed")
        if url == CHAT_URL:
            raise Unsupported(f"url {url}: this is an embedding job (--task embed); it takes {EMBEDDINGS_URL} lines")
        raise Unsupported(f"url {url!r} is not served; a batch job takes {CHAT_URL} (--task caption, ocr) or "
                          f"{EMBEDDINGS_URL} (--task embed)")
    body = line.get("body")
    if not isinstance(body, Mapping):
        raise BadRequest(f"body must be a JSON object (the request), got {type(body).__name__}")
    return body


def chat_request(item: Item, task: str, max_new_tokens: int) -> ChatRequest:
    """A caption or OCR line's chat-completions request: `max_new_tokens` where it sets no
    max_tokens, and thinking off unless it asks for thinking (a caption or a transcription is
    wanted, not a reasoning trace; a reasoning_effort other than "none" asks)."""
    request = parse_chat_request(_body(item, task))
    if request.streaming.stream:
        raise BadRequest("stream: a batch line gets one whole reply; drop stream")
    kwargs = dict(request.chat.kwargs)
    if "thinking" not in kwargs and "enable_thinking" not in kwargs and kwargs.get("reasoning_effort") is None:
        kwargs["thinking"] = False
    params = request.params
    if params.max_new_tokens is None:
        params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
    return dataclasses.replace(request, chat=dataclasses.replace(request.chat, kwargs=kwargs), params=params)


def embedding_request(item: Item) -> tuple[str | None, MediaRef]:
    """An embedding line's model and its one image."""
    body = _body(item, "embed")
    if "input" in body:
        raise Unsupported("input: text embeddings are not served; give one image as an image_url part in messages "
                          "(vLLM's multimodal form)")
    unknown = sorted(set(body) - set(EMBEDDING_FIELDS))
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; an embedding line takes {list(EMBEDDING_FIELDS)}")
    if body.get("encoding_format") not in (None, "float"):
        raise Unsupported(f"encoding_format={body['encoding_format']!r} is not supported (only 'float': the "
                          "rows are written to safetensors shards as float32)")
    request = parse_chat_request({key: body[key] for key in ("model", "messages") if key in body})
    messages = request.chat.messages
    contents = [m.get("content") for m in messages]
    parts = sum(1 if isinstance(content, str) else len(content or []) for content in contents)
    if len(request.media) != 1 or parts != 1 or any(m["role"] != "user" for m in messages):
        raise BadRequest("messages must hold one user message with exactly one image_url part and nothing else "
                         f"(this one has {len(request.media)} image(s) in {parts} part(s))")
    return request.model, request.media[0]
