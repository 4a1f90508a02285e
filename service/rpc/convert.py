"""Protobuf <-> engine types: requests become `MediaInput`/`ChatInput`/`SamplingParams`, engine
results become messages and raw tensor bytes. Nothing here does model work; what the wire format
alone decides (a JSON text field, a media type, a dtype name) is checked here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from service.engine import ChatInput, Choice, GenerationResult, Logprobs, MediaInput, SamplingParams, TokenLogprob
from service.errors import BadRequest, Unsupported
from service.jsontext import parse_json
from service.media import check_detail, item_uuid
from service.rpc._proto import vision_pb2 as pb
from textcore import parser as p
from vision.buffers import BufferPool
from vision.errors import ImageOptionsError
from vision.media import Modality
from vision.options import ImageOptions
from vision.preprocess import Preprocessed, patchify_normalise

CHUNK_BYTES = 4 << 20  # embedding data chunks (the proto's bound)
# Float patches for Preprocess replies are built in reused, already-touched buffers (a fresh
# 145 MB one per 12 MP image is mostly page faults); two kept, for two such calls at once.
_PATCH_BUFFERS = BufferPool(np.float32, keep=2)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


# The media type's family names the item's modality (no type: an image).
MODALITIES = {"image": Modality.IMAGE, "video": Modality.VIDEO}


def media_input(image: pb.Image, where: str = "") -> MediaInput:
    """`where` locates the item in a chat (empty for the single-item RPCs). Its modality is what its
    media type says (the engine's check refuses what the model does not take)."""
    label = where or "image"
    mime = image.mime_type.strip().lower()
    modality = MODALITIES.get(mime.partition("/")[0]) if mime else Modality.IMAGE
    if modality is None:
        raise Unsupported(f"{label}: media type {mime!r} is not supported; send an image")
    check_detail(image.detail, label)
    o = image.options
    try:
        options = ImageOptions(max_tokens=o.max_tokens or None, exif_transpose=o.exif_transpose,
                               resize=o.resize or "exact")
    except ImageOptionsError as exc:
        raise BadRequest(f"{label}: options: {exc}") from None
    uuid = item_uuid(image.uuid or None, label)  # proto3: an empty uuid is no uuid
    # One read of `data`: each read of a protobuf bytes field copies it.
    return MediaInput(image.data, modality, options, where, uuid)


def _json_field(text: str, name: str, kind: type) -> Any:
    if not text:
        return None
    value = parse_json(text, name)
    if not isinstance(value, kind):
        raise BadRequest(f"{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def chat_input(messages: Sequence[pb.ChatMessage], tools_json: str, thinking_effort: str,
               chat_kwargs_json: str) -> tuple[ChatInput, list[MediaInput]]:
    """The chat as the template's dicts, and its media parts' items in order."""
    if not messages:
        raise BadRequest("messages is empty")
    images: list[MediaInput] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role}
        parts: list[dict[str, Any]] = []
        for k, part in enumerate(m.content):
            which = part.WhichOneof("part")
            if which == "text":
                parts.append({"type": "text", "text": part.text})
            elif which == "image":
                images.append(media_input(part.image, f"messages[{i}].content[{k}]"))
                parts.append({"type": "image"})
            else:
                raise BadRequest(f"messages[{i}].content[{k}] is neither text nor image")
        d["content"] = parts
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json}} for c in m.tool_calls]
        out.append(d)
    tools = _json_field(tools_json, "tools_json", list)
    kwargs = _json_field(chat_kwargs_json, "chat_kwargs_json", dict) or {}
    if thinking_effort == "medium":
        kwargs["thinking_effort"] = None  # named by the template's message, but it injects nothing
    elif thinking_effort:
        kwargs["thinking_effort"] = thinking_effort
    return ChatInput(out, tools, kwargs), images


def sampling(request: pb.GenerateRequest) -> SamplingParams:
    """The request's `Sampling` as `SamplingParams` (a field's zero, or its absence for the optional
    ones, is its neutral value; `max_new_tokens` 0: what the prompt leaves of the model length)."""
    s = request.sampling
    return SamplingParams(
        max_new_tokens=request.max_new_tokens or None, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
        n=s.n or 1, logprobs=s.logprobs, top_logprobs=s.top_logprobs, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_tokens=s.min_tokens, ignore_eos=s.ignore_eos, logit_bias=dict(s.logit_bias),
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True, min_p=s.min_p,
        include_stop_str_in_output=s.include_stop_str_in_output,
        spaces_between_special_tokens=(s.spaces_between_special_tokens if s.HasField("spaces_between_special_tokens")
                                       else True), allowed_token_ids=tuple(s.allowed_token_ids) or None)


def out_dtype(name: str) -> str:
    name = name or "float32"
    if name not in TORCH_DTYPES:
        raise BadRequest(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}")
    return name


def tensor_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """Raw little-endian row-major bytes of `t` cast to `dtype` (bfloat16 as its 16-bit words)."""
    t = t.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
    if dtype == "bfloat16":
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def pixels_tensor(pre: Preprocessed, patches: bool) -> pb.Tensor:
    """The model input as a Tensor: float32 patches [N, 3, 14, 14] (built here, in a reused buffer)
    or the padded uint8 image [H, W, 3]."""
    if not patches:
        return _tensor(pre.image, "uint8")
    with _PATCH_BUFFERS.take(pre.pixel_values_size) as out:
        return _tensor(patchify_normalise(pre.image, out), "float32")


def _tensor(array: np.ndarray, dtype: str) -> pb.Tensor:
    little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=little_endian.tobytes())


def chunks(data: bytes) -> list[memoryview]:
    view = memoryview(data)
    return [view[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


def _logprob(entry: TokenLogprob, logprobs: Logprobs) -> pb.TokenLogprob:
    token, data = logprobs.text(entry)  # here, not on the trunk's thread
    return pb.TokenLogprob(token=token, bytes=data, logprob=entry.logprob, token_id=entry.token_id)


def event(choice: Choice) -> pb.GenerateEvent | None:
    """An item of `Engine.generate` as a GenerateEvent (None for events the wire does not carry)."""
    message = _event(choice.item)
    if message is not None:
        message.index = choice.index
    return message


def _event(item: p.Event | Logprobs | GenerationResult) -> pb.GenerateEvent | None:
    if isinstance(item, Logprobs):
        return pb.GenerateEvent(logprobs=pb.Logprobs(chosen=_logprob(item.chosen, item),
                                                     top=[_logprob(e, item) for e in item.top]))
    if isinstance(item, GenerationResult):
        return pb.GenerateEvent(finish=pb.Finish(
            reason=_FINISH[item.finish_reason],
            usage=pb.Usage(prompt_tokens=item.prompt_tokens, image_tokens=item.image_tokens,
                           completion_tokens=item.completion_tokens)))
    if isinstance(item, p.ReasoningDelta):
        return pb.GenerateEvent(reasoning_delta=item.text)
    if isinstance(item, p.ContentDelta):
        return pb.GenerateEvent(content_delta=item.text)
    if isinstance(item, p.ToolCallStart):
        return pb.GenerateEvent(tool_call_start=pb.ToolCallStart(index=item.index, name=item.name))
    if isinstance(item, p.ToolArgumentDelta):
        return pb.GenerateEvent(argument_delta=pb.ToolArgumentDelta(
            index=item.index, key=item.key or "", type=item.type, text=item.text))
    if isinstance(item, p.ToolArgumentError):
        return pb.GenerateEvent(argument_error=pb.ToolArgumentError(
            index=item.index, key=item.key or "", type=item.type, message=item.message, raw=item.raw))
    if isinstance(item, p.ToolCallEnd):
        return pb.GenerateEvent(tool_call_end=pb.ToolCallEnd(
            index=item.index, name=item.name, arguments_json=json.dumps(item.arguments, ensure_ascii=False)))
    if isinstance(item, p.ProtocolError):
        return pb.GenerateEvent(protocol_error=item.message)
    return None  # ToolArgumentDone (carried by ToolCallEnd), Stop (carried by Finish)
