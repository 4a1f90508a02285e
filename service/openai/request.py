"""An OpenAI chat-completions request body -> what the engine takes.

The body is the one `POST /v1/chat/completions` receives and the one an OpenAI-batch line carries
under `body`. Messages pass to the K3 chat template nearly as they are (it reads OpenAI messages:
string or part-list content, assistant `tool_calls`, `reasoning_content`, tool results); each
`image_url` part becomes `{"type": "image"}` and an `ImagePart` saying where its bytes are. The
image bytes are fetched afterwards, by the face that knows what it may read (`images.py`).

Every parameter a caller may send is either honoured (OpenAI's sampling parameters and vLLM's
extras: `stop`, `n`, `logprobs`, the penalties, `logit_bias`, `min_tokens`, `ignore_eos`, ...),
accepted at its neutral value (`parallel_tool_calls: true`), or refused with an error naming it:
nothing is silently ignored. Here only the JSON types are checked; the ranges are `SamplingParams`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.engine import ChatInput, ImageInput, SamplingParams
from service.errors import BadRequest, Unsupported
from textcore.chat import CHAT_KWARGS

# Parameters that change the result and that the engine honours (besides messages and tools), by
# JSON type; each is the `SamplingParams` field of the same name.
NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGERS = ("top_k", "n", "top_logprobs", "min_tokens")
FLAGS = ("logprobs", "ignore_eos", "skip_special_tokens")
SAMPLING = (*NUMBERS, *INTEGERS, *FLAGS, "seed", "stop", "stop_token_ids", "logit_bias")
# Accepted at these values only (what the engine does anyway); another value is refused.
NEUTRAL: dict[str, Any] = {"parallel_tool_calls": True}
# Accepted and without effect on the reply (who asked, what for).
INERT = ("user", "metadata", "store", "service_tier")
# OpenAI's own parameters that are chat-template keyword arguments (CHAT_KWARGS): passed to it as they are.
TEMPLATE = ("tool_choice", "response_format", "reasoning_effort")
KNOWN = {"messages", "model", "tools", "max_tokens", "max_completion_tokens", "stream", "stream_options",
         "chat_template_kwargs", *SAMPLING, *NEUTRAL, *INERT, *TEMPLATE}


@dataclass(frozen=True)
class ImagePart:
    """Where one image part's bytes are, as the request gives them."""

    url: str  # a data: URL, an http(s) URL, a file:// URL or a path
    where: str  # "messages[0].content[1]"
    uuid: str | None = None  # a client's own item id (vLLM then uses it verbatim as the item's mm_hash)


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # the template's form: each image part is {"type": "image"}
    images: list[ImagePart]
    tools: list[Any] | None = None
    model: str | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # the SAMPLING keys the request set
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    chat_kwargs: dict[str, Any] = field(default_factory=dict)

    def chat_input(self, images: list[bytes]) -> ChatInput:
        """The engine's chat, given the bytes of `images` (in order)."""
        if len(images) != len(self.images):
            raise ValueError(f"{len(self.images)} image parts but {len(images)} images")
        inputs = [ImageInput(data, where=part.where, uuid=part.uuid) for data, part in zip(images, self.images,
                                                                                              strict=True)]
        return ChatInput(self.messages, self.tools, dict(self.chat_kwargs), inputs)


def _int(body: Mapping[str, Any], key: str, *, minimum: int | None = None, maximum: int = 2**31 - 1) -> int | None:
    """An integer the gRPC wire can carry (a batch line may go to a server): `maximum` for its
    uint32 fields (the seed is a uint64), `minimum` where the wire decides one too (the seed's 0;
    max_tokens' 1, as its 0 means "unset"). Sampling ranges are `SamplingParams`'."""
    value = body.get(key)
    if value is None:
        return None
    if (not isinstance(value, int) or isinstance(value, bool) or value > maximum
            or (minimum is not None and value < minimum)):
        bounds = f"up to {maximum}" if minimum is None else f"from {minimum} to {maximum}"
        raise BadRequest(f"{key} must be an integer {bounds}, got {value!r}")
    return value


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    return float(value)


def _flag(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _token_id(value: Any, key: str) -> int:
    """A token id (the uint32 the gRPC wire carries); in the vocabulary is `SamplingParams`' check."""
    if isinstance(value, str) and value.strip().isdigit():  # logit_bias keys: JSON object keys are strings
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 2**32 - 1:
        raise BadRequest(f"{key} must hold token ids (integers from 0), got {value!r}")
    return value


def sampling_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters `body` sets, as `SamplingParams` fields (types checked here)."""
    out: dict[str, Any] = {key: value for key in NUMBERS if (value := _number(body, key)) is not None}
    out |= {key: value for key in INTEGERS if (value := _int(body, key)) is not None}
    out |= {key: value for key in FLAGS if (value := _flag(body, key)) is not None}
    if (value := _int(body, "seed", minimum=0, maximum=2**64 - 1)) is not None:
        out["seed"] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}")
        out["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest(f"stop_token_ids must be a list of token ids, got {ids!r}")
        out["stop_token_ids"] = [_token_id(i, "stop_token_ids") for i in ids]
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise BadRequest(f"logit_bias must be an object of token id -> bias, got {bias!r}")
        out["logit_bias"] = {}
        for key, value in bias.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise BadRequest(f"logit_bias[{key!r}] must be a number, got {value!r}")
            out["logit_bias"][_token_id(key, "logit_bias")] = float(value)
    return out


def _image_part(part: Mapping[str, Any], where: str) -> ImagePart:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}: image_url.url must be a non-empty string")
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise BadRequest(f"{where}: uuid must be a non-empty string")
    return ImagePart(url, where, uuid)


def _message(message: Any, i: int, images: list[ImagePart]) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string role")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image_url":
                images.append(_image_part(part, f"{where}.content[{k}]"))
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("input_audio", "audio_url", "video_url", "file"):
                raise Unsupported(f"{where}.content[{k}]: {kind} parts are not supported; Kimi-K3 takes images "
                                  "and text")
            else:
                raise BadRequest(f"{where}.content[{k}]: a part is {{'type': 'text', 'text': ...}} or "
                                 "{'type': 'image_url', 'image_url': {'url': ...}}")
        out["content"] = parts
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a chat-completions body and split it into the template's messages, the image parts
    and the generation settings. Raises BadRequest / Unsupported / SamplingError naming the field."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; this server takes {sorted(KNOWN)}")
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value not in (None, neutral):
            raise Unsupported(f"{key}={value!r} is not supported (only {neutral!r})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    images: list[ImagePart] = []
    template_messages = [_message(m, i, images) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {model!r}")
    max_tokens = _int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", minimum=1)
    sampling = sampling_options(body)
    # the ranges (a SamplingError), before any image is fetched; the server's default length is the engine's
    SamplingParams(**sampling, **({"max_new_tokens": max_tokens} if max_tokens else {}))
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options must be an object")
    chat_kwargs = {key: body[key] for key in TEMPLATE if body.get(key) is not None}
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadRequest("chat_template_kwargs must be an object")
    refused = sorted(set(extra) - set(CHAT_KWARGS))  # every keyword argument the template takes, as vLLM passes them
    if refused:
        raise Unsupported(f"chat_template_kwargs {refused} are not supported; allowed: {list(CHAT_KWARGS)}")
    chat_kwargs.update(extra)
    return ChatRequest(template_messages, images, tools, model, max_tokens, sampling, bool(stream),
                       bool(options.get("include_usage")), chat_kwargs)
