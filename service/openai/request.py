"""An OpenAI chat-completions or completions request body -> what the engine takes.

A chat body is the one `POST /v1/chat/completions` receives and the one an OpenAI-batch line
carries under `body`; a completions body (`parse_completion_request`) is `POST /v1/completions`'s:
a prompt of text or token ids (one, or a list), with the same sampling parameters, read by the same
code (`_generation`), and vLLM's completions extras (`echo`, `logprobs` as a count); vLLM's
`/tokenize` and `/detokenize` bodies too. Messages pass to the K3 chat template nearly as they
are (it reads OpenAI messages: string or part-list content, assistant `tool_calls`,
`reasoning_content`, tool results); each media part becomes `{"type": "image"}` and a `MediaRef`
saying where its bytes are: an `image_url` part by the one image-part rule of every face
(`service.media.image_url`: `url` and `detail`), a `video_url` part as a video item (which the
engine's check refuses, as K3's processor does). The bytes are fetched afterwards, by the face
that knows what it may read (`service.fetch`). The sampling parameters become `SamplingParams`
here, once.

Every parameter a caller may send is either honoured (OpenAI's sampling parameters and vLLM's
extras: `stop`, `n`, `logprobs`, the penalties, `logit_bias`, `min_p`, `min_tokens`, `ignore_eos`,
`allowed_token_ids`, `include_stop_str_in_output`, `spaces_between_special_tokens`, ...; `stream_options` with
`include_usage` and `continuous_usage_stats`), accepted at its neutral value
(`parallel_tool_calls: true`, `use_beam_search: false`), or refused with an error naming it:
nothing is silently ignored. The parameters of vLLM's APIs that this trunk cannot honour
(`prompt_logprobs`, `bad_words`, `structured_outputs`, ...) are refused by name like any other.
Here only the JSON types are checked; the ranges are `SamplingParams'`.
An EC producer, which samples nothing, takes every parameter of vLLM's chat API instead
(`parse_producer_request`). `tools`, `tool_choice` and `response_format` must have OpenAI's shapes
(those of the `openai` SDK's request types). JSON text a caller sends (an HTTP body, a gRPC JSON
field, a batch job's JSONL line) is read by one depth rule on every face (`service.jsontext`), so a
body reaches `parse_chat_request` already parsed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from service.engine import ChatInput, SamplingParams
from service.errors import BadRequest, TooLarge, Unsupported
from service.media import MediaRef, image_url, item_uuid
from vision.media import Modality

# Parameters that change the result and that the engine honours (besides messages and tools), by
# JSON type; each is the `SamplingParams` field of the same name.
NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGERS = ("top_k", "n", "top_logprobs", "min_tokens")
FLAGS = ("logprobs", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens")
TOKEN_LISTS = ("stop_token_ids", "allowed_token_ids")
SAMPLING = (*NUMBERS, *INTEGERS, *FLAGS, *TOKEN_LISTS, "seed", "stop", "logit_bias")
# Accepted at these values only (what the engine does anyway); another value is refused. The
# sampling ones are vLLM's (no beam search; every request has the one priority).
NEUTRAL_SAMPLING: dict[str, Any] = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0}
NEUTRAL: dict[str, Any] = {"parallel_tool_calls": True, **NEUTRAL_SAMPLING}
# Accepted and without effect on the reply (who asked, what for).
INERT = ("user", "metadata", "store", "service_tier")
# OpenAI's own parameters that are chat-template keyword arguments (CHAT_KWARGS): passed to it as they are.
TEMPLATE = ("tool_choice", "response_format", "reasoning_effort")
# The chat's media parts, by OpenAI's part type: each holds a {"url", "detail"} spec.
MEDIA_PARTS = {"image_url": Modality.IMAGE, "video_url": Modality.VIDEO}
KNOWN = {"messages", "model", "tools", "max_tokens", "max_completion_tokens", "stream", "stream_options",
         "chat_template_kwargs", *SAMPLING, *NEUTRAL, *INERT, *TEMPLATE}
# A completions body: the chat's sampling, but `logprobs` is a count (OpenAI's completions shape)
# and there is no top_logprobs. `suffix` is refused (no fill-in-the-middle here); echo and logprobs
# together would need the prompt's logprobs, which are not computed.
COMPLETION_KNOWN = {"prompt", "model", "max_tokens", "stream", "stream_options", "echo", "suffix", "add_special_tokens",
                    *(set(SAMPLING) - {"top_logprobs"}), *NEUTRAL_SAMPLING, *INERT}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # vLLM's StreamOptions
COMPLETION_MAX_TOKENS = 16  # max_tokens when absent, as OpenAI's and vLLM's completions (null: the room left)
MAX_PROMPTS = 1024  # prompts in one completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default)
MAX_LOGPROBS = 20  # a completions `logprobs` count, as top_logprobs (vLLM's max_logprobs default)
# -- OpenAI's shapes for tools, tool_choice and response_format (openai.types.chat) --------------

Check = Callable[[Any, str], None]
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _string(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string, got {_json_type(value)}")


def _function_name(value: Any, where: str) -> None:
    _string(value, where)
    if not _FUNCTION_NAME.fullmatch(value):
        raise BadRequest(f"{where} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got {value!r}")


def _optional_bool(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{where} must be true, false or null, got {_json_type(value)}")


def _any_object(value: Any, where: str) -> None:
    if not isinstance(value, Mapping):
        raise BadRequest(f"{where} must be an object, got {_json_type(value)}")


def _one_of(*allowed: str) -> Check:
    def check(value: Any, where: str) -> None:
        if value not in allowed:
            raise BadRequest(f"{where} must be one of {list(allowed)}, got {value!r}")
    return check


def _fields(required: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """An object with these fields (no others: a misspelt one is named, not ignored)."""
    optional = optional or {}

    def check(value: Any, where: str) -> None:
        _any_object(value, where)
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            raise BadRequest(f"{where} has unknown field(s) {unknown}; allowed: {sorted({*required, *optional})}")
        for key, field_check in required.items():
            if key not in value:
                raise BadRequest(f"{where}.{key} is required")
            field_check(value[key], f"{where}.{key}")
        for key, field_check in optional.items():
            if key in value:
                field_check(value[key], f"{where}.{key}")
    return check


def _by_type(shapes: Mapping[str, Check]) -> Check:
    """An object whose `type` picks its shape."""
    def check(value: Any, where: str) -> None:
        _any_object(value, where)
        kind = value.get("type")
        if kind not in shapes:
            raise BadRequest(f"{where}.type must be one of {list(shapes)}, got {kind!r}")
        shapes[kind](value, where)
    return check


def _list_of(item: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise BadRequest(f"{where} must be an array, got {_json_type(value)}")
        for i, element in enumerate(value):
            item(element, f"{where}[{i}]")
    return check


_TYPE = {"type": _string}
_TOOL = _by_type({
    "function": _fields({**_TYPE, "function": _fields({"name": _function_name}, {
        "description": _string, "parameters": _any_object, "strict": _optional_bool})}),
    "custom": _fields({**_TYPE, "custom": _fields({"name": _string}, {"description": _string, "format": _by_type({
        "text": _fields(_TYPE),
        "grammar": _fields({**_TYPE, "grammar": _fields({"definition": _string,
                                                         "syntax": _one_of("lark", "regex")})})})})}),
})
_TOOL_CHOICE_OBJECT = _by_type({
    "function": _fields({**_TYPE, "function": _fields({"name": _string})}),
    "custom": _fields({**_TYPE, "custom": _fields({"name": _string})}),
    "allowed_tools": _fields({**_TYPE, "allowed_tools": _fields({"mode": _one_of("auto", "required"),
                                                                 "tools": _list_of(_any_object)})}),
})
_RESPONSE_FORMAT = _by_type({
    "text": _fields(_TYPE),
    "json_object": _fields(_TYPE),
    "json_schema": _fields({**_TYPE, "json_schema": _fields({"name": _function_name}, {
        "description": _string, "schema": _any_object, "strict": _optional_bool})}),
})


def _check_tools(tools: Any, tool_choice: Any, response_format: Any) -> None:
    if tools is not None:
        _list_of(_TOOL)(tools, "tools")
    if response_format is not None:
        _RESPONSE_FORMAT(response_format, "response_format")
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        _one_of("none", "auto", "required")(tool_choice, "tool_choice")
    else:
        _TOOL_CHOICE_OBJECT(tool_choice, "tool_choice")
    if tool_choice != "none" and not tools:  # as vLLM
        raise BadRequest(f"tool_choice {tool_choice!r} needs tools; give tools or drop tool_choice")
    kind = tool_choice.get("type") if isinstance(tool_choice, Mapping) else None
    if kind in ("function", "custom"):
        name = tool_choice[kind]["name"]
        names = [tool[kind]["name"] for tool in tools if tool["type"] == kind]
        if name not in names:
            raise BadRequest(f"tool_choice.{kind}.name {name!r} is not one of the {kind} tools given: {names}")

# Every field of vLLM 0.33.0's ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py),
# in its order: what vLLM's proxies may pass on to an encoder, all of which an EC producer takes
# (`parse_producer_request`; tests/test_http.py sends each of them).
VLLM_CHAT_PARAMETERS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs",
    "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
    "return_token_ids", "return_weight_versions", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval")
# What an EC producer reads of them (the images, the model, the prompt it counts, the reply's form);
# the rest change nothing, as nothing is sampled.
PRODUCER_READS = ("messages", "model", "tools", "stream", "stream_options", "chat_template_kwargs", *TEMPLATE)
# vLLM's image options: vLLM would preprocess (and key) the images by them, which this encoder does
# not follow (it preprocesses as the release does), so a value is refused rather than ignored.
PRODUCER_REFUSES = ("mm_processor_kwargs", "media_io_kwargs")


@dataclass(frozen=True)
class Streaming:
    """How a reply goes out: whole, or as server-sent events (`stream`), with the usage in a last
    chunk (`include_usage`) and then in every chunk too (`continuous_usage`, vLLM's
    `continuous_usage_stats`, which takes effect with include_usage, as in vLLM)."""

    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    chat: ChatInput  # the template's form: each media part is {"type": "image"}
    media: list[MediaRef]  # where each media part's bytes are, in the chat's order
    params: SamplingParams | None  # None for an EC producer, which samples nothing
    model: str | None = None
    streaming: Streaming = Streaming()


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # text, or token ids; each is a generation of its own
    params: SamplingParams
    model: str | None = None
    streaming: Streaming = Streaming()
    echo: bool = False  # each choice's text begins with its prompt's


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


def _streaming(body: Mapping[str, Any]) -> Streaming:
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return Streaming(bool(stream))
    _fields({}, dict.fromkeys(STREAM_OPTIONS, _optional_bool))(options, "stream_options")
    if options and not stream:  # as vLLM
        raise BadRequest("stream_options can only be given with stream: true")
    usage = bool(options.get("include_usage"))
    return Streaming(bool(stream), usage, usage and bool(options.get("continuous_usage_stats")))


def _generation(body: Mapping[str, Any], default_max_tokens: int | None,
                **fields: Any) -> tuple[SamplingParams, Streaming]:
    """The sampling and the reply's form of a chat or completions body (`fields`: what the route
    reads itself, as `SamplingParams` fields), the ranges checked before any image is fetched
    (`max_tokens` null or absent without a default: the room the model length leaves)."""
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value not in (None, neutral):
            raise Unsupported(f"{key}={value!r} is not supported (only {neutral!r})")
    max_tokens = _int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", minimum=1)
    if max_tokens is None and "max_tokens" not in body:
        max_tokens = default_max_tokens
    read = {key: value for key, value in body.items() if key not in fields}
    params = SamplingParams(**(sampling_options(read) | fields), max_new_tokens=max_tokens)
    return params, _streaming(body)


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
    for key in TOKEN_LISTS:
        ids = body.get(key)
        if ids is not None:
            if not isinstance(ids, list):
                raise BadRequest(f"{key} must be a list of token ids, got {ids!r}")
            out[key] = [_token_id(i, key) for i in ids]
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


def _media_part(part: Mapping[str, Any], kind: str, where: str) -> MediaRef:
    uuid = item_uuid(part.get("uuid"), where)
    return MediaRef(image_url(part.get(kind), f"{where}.{kind}"), where, MEDIA_PARTS[kind], uuid)


def _message(message: Any, i: int, media: list[MediaRef]) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string role")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in MEDIA_PARTS:
                media.append(_media_part(part, kind, f"{where}.content[{k}]"))
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("input_audio", "audio_url", "file"):
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
    and the generation settings. Raises BadRequest / Unsupported / SamplingError / ChatError naming the field."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; this server takes {sorted(KNOWN)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    media: list[MediaRef] = []
    template_messages = [_message(m, i, media) for i, m in enumerate(messages)]
    tools = body.get("tools")
    _check_tools(tools, body.get("tool_choice"), body.get("response_format"))
    model = _model(body)
    params, streaming = _generation(body, None)
    chat_kwargs = {key: body[key] for key in TEMPLATE if body.get(key) is not None}
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadRequest("chat_template_kwargs must be an object")
    chat_kwargs.update(extra)  # every keyword argument the template takes, as vLLM passes them (ChatInput checks)
    return ChatRequest(ChatInput(template_messages, tools, chat_kwargs), media, params, model, streaming)


def _model(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {model!r}")
    return model


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """vLLM's four prompt forms (a string, strings, token ids, lists of token ids) as a list of
    prompts; ids are checked against the vocabulary when each is prepared."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids, and not empty")
    if _is_ids(prompt):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise TooLarge(f"prompt holds {len(prompt)} prompts; this server takes at most {MAX_PROMPTS} per request")
    for i, one in enumerate(prompt):
        if isinstance(one, Mapping):
            raise Unsupported(f"prompt[{i}] is an object; a completions prompt is text or token ids. Images are a "
                              "chat feature: send them as image_url parts to /v1/chat/completions")
        if not (isinstance(one, str) or _is_ids(one)):
            raise BadRequest(f"prompt[{i}] must be a string or a list of token ids, got {_json_type(one)}")
    if len({isinstance(one, str) for one in prompt}) > 1:
        raise BadRequest("prompt must hold strings or lists of token ids, not both")
    return list(prompt)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Check a completions body: its prompts, and its sampling and reply's form as a chat body's.
    Raises BadRequest / TooLarge / Unsupported / SamplingError naming the field."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - COMPLETION_KNOWN)
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; this server takes {sorted(COMPLETION_KNOWN)}")
    if body.get("suffix") is not None:
        raise Unsupported("suffix is not supported: Kimi-K3 has no fill-in-the-middle; send the prompt alone")
    if "prompt" not in body:
        raise BadRequest("prompt is required")
    prompts = _prompts(body["prompt"])
    echo = _flag(body, "echo") or False
    _flag(body, "add_special_tokens")  # true or false alike: this tokenizer adds no special tokens to text
    count = _int(body, "logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if echo and count is not None:
        raise Unsupported("echo with logprobs needs the prompt's logprobs, which this server does not compute; "
                          "drop one of them")
    fields = {} if count is None else {"logprobs": True, "top_logprobs": count}
    params, streaming = _generation(body, COMPLETION_MAX_TOKENS, **fields)
    return CompletionRequest(prompts, params, _model(body), streaming, echo)


def parse_producer_request(body: Any) -> ChatRequest:
    """A chat request to an EC producer (`--ec-role producer`): every vLLM chat parameter is taken,
    whatever its value, since nothing is sampled; the images, the model and the reply's form are read
    as `parse_chat_request` reads them. Refused by name: a parameter vLLM does not have, vLLM's image
    options, and a push to a Mooncake EC consumer (`ec_transfer_params.consumer_zmq`)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(VLLM_CHAT_PARAMETERS))
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; an EC producer takes vLLM's chat parameters")
    for key in PRODUCER_REFUSES:
        if body.get(key):
            raise Unsupported(f"{key}={body[key]!r} is not supported: this encoder preprocesses every image as "
                              "Kimi-K3's release processor does; drop it on the vLLM side")
    transfer = body.get("ec_transfer_params")
    if isinstance(transfer, Mapping) and transfer.get("consumer_zmq") is not None:
        raise Unsupported("ec_transfer_params.consumer_zmq (a push to vLLM's Mooncake EC consumer) is not supported; "
                          "this encoder publishes files for the shared-storage connector (ECExampleConnector)")
    request = parse_chat_request({key: body[key] for key in PRODUCER_READS if key in body})
    return dataclasses.replace(request, params=None)


# vLLM's /tokenize: a prompt, or chat messages (rendered as a chat request's are).
TOKENIZE_PROMPT_KNOWN = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_KNOWN = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                       "tools", "chat_template_kwargs", "return_token_strs"}
TOKENIZE_NEUTRAL: dict[str, Any] = {"return_token_strs": False, "continue_final_message": False}


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None  # a prompt's text, or
    chat: ChatInput | None  # a chat, its media beside it
    media: list[MediaRef]
    model: str | None = None


@dataclass(frozen=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """vLLM's tokenize request: `prompt` (text, as a completion's prompt is read) or `messages`
    (a chat, its images counted from their headers), never both."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise BadRequest("give prompt (text) or messages (a chat), one of them")
    known = TOKENIZE_CHAT_KNOWN if chat else TOKENIZE_PROMPT_KNOWN
    unknown = sorted(set(body) - known)
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; /tokenize takes {sorted(known)}")
    for key, neutral in TOKENIZE_NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise Unsupported(f"{key}={body[key]!r} is not supported (only {neutral!r})")
    _flag(body, "add_special_tokens")  # true or false alike: this tokenizer adds no special tokens
    model = _model(body)
    if not chat:
        if not isinstance(body["prompt"], str):
            raise BadRequest(f"prompt must be a string, got {_json_type(body['prompt'])}")
        return TokenizeRequest(body["prompt"], None, [], model)
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    media: list[MediaRef] = []
    template_messages = [_message(m, i, media) for i, m in enumerate(messages)]
    tools = body.get("tools")
    _check_tools(tools, None, None)
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadRequest("chat_template_kwargs must be an object")
    kwargs = dict(extra)
    generation_prompt = _flag(body, "add_generation_prompt")
    if generation_prompt is not None:
        kwargs["add_generation_prompt"] = generation_prompt
    return TokenizeRequest(None, ChatInput(template_messages, tools, kwargs), media, model)


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    """vLLM's detokenize request: `tokens`, the ids (in the vocabulary is the engine's check)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise Unsupported(f"unsupported parameter(s) {unknown}; /detokenize takes ['model', 'tokens']")
    tokens = body.get("tokens")
    if not _is_ids(tokens):
        raise BadRequest("tokens must be a list of token ids (integers)")
    return DetokenizeRequest(tokens, _model(body))
