"""Python clients for `kimi.vision.v1.VisionService`: `VisionClient` (blocking) and
`AsyncVisionClient` (asyncio). Both set message-size limits explicitly (gRPC's default receive
limit is 4 MiB, far below one image's pixels) and return embeddings as numpy arrays.

    with VisionClient("127.0.0.1:50051") as client:
        info = client.preprocess(open("cat.jpg", "rb").read())
        header, rows = client.embed(open("cat.jpg", "rb").read())
        for event in client.generate([user("What is this?", open("cat.jpg", "rb").read())]):
            ...

Failures arrive as `grpc.RpcError` with the server's status code and reason.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.rpc import MAX_FRAME_BYTES
from service.rpc._proto import vision_pb2 as pb
from service.rpc._proto import vision_pb2_grpc as pb_grpc

SERVICE_NAME = "kimi.vision.v1.VisionService"
DEFAULT_MAX_SEND_BYTES = 64 << 20
DEFAULT_MAX_RECEIVE_BYTES = 256 << 20

_NUMPY_DTYPES = {
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
}


def to_numpy(dtype: str, shape: Iterable[int], data: bytes) -> np.ndarray:
    """Decode raw little-endian row-major bytes; bfloat16 is widened to float32 (exactly)."""
    shape = tuple(int(s) for s in shape)
    if dtype == "bfloat16":
        words = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return words.view(np.float32).reshape(shape)
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    return np.frombuffer(data, dtype=np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def tensor_to_numpy(tensor: pb.Tensor) -> np.ndarray:
    return to_numpy(tensor.dtype, tensor.shape, tensor.data)


def image(data: bytes, *, mime_type: str = "", exif_transpose: bool = False, max_tokens: int = 0,
          resize: str = "") -> pb.Image:
    return pb.Image(
        data=data,
        mime_type=mime_type,
        options=pb.ImageOptions(exif_transpose=exif_transpose, max_tokens=max_tokens, resize=resize),
    )


def message(role: str, *parts: str | bytes | pb.Image, name: str = "", tool_call_id: str = "") -> pb.ChatMessage:
    """A chat message from text (`str`) and image (`bytes` or `pb.Image`) parts, in order."""
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append(pb.ContentPart(text=part))
        elif isinstance(part, bytes | bytearray | memoryview):
            content.append(pb.ContentPart(image=image(bytes(part))))
        elif isinstance(part, pb.Image):
            content.append(pb.ContentPart(image=part))
        else:
            raise TypeError(f"a content part is str (text), bytes or Image (image), not {type(part).__name__}")
    return pb.ChatMessage(role=role, content=content, name=name, tool_call_id=tool_call_id)


def user(*parts: str | bytes | pb.Image) -> pb.ChatMessage:
    return message("user", *parts)


def system(text: str) -> pb.ChatMessage:
    return message("system", text)


def _as_image(data: bytes | pb.Image) -> pb.Image:
    return data if isinstance(data, pb.Image) else image(data)


def _tools_json(tools: list[dict] | str | None) -> str:
    if tools is None:
        return ""
    return tools if isinstance(tools, str) else json.dumps(tools)


def _kwargs_json(kwargs: dict | None) -> str:
    return json.dumps(kwargs) if kwargs else ""


@dataclass
class Encoded:
    """An `Encode` answer: the expanded prompt and the image rows, ready to prefill elsewhere."""

    header: pb.EncodeHeader
    embeddings: np.ndarray  # [num_rows, hidden_size], images in span order

    @property
    def input_ids(self) -> list[int]:
        return list(self.header.input_ids)


def _collect(chunks: list[pb.EmbedChunk] | list[pb.EncodeChunk]) -> tuple[Any, np.ndarray]:
    """An Embed or Encode stream, received whole -> (its header, its rows). The header comes first;
    every other chunk carries bytes of the rows."""
    if not chunks or not chunks[0].HasField("header"):
        raise RuntimeError("the stream did not begin with its header")
    header = chunks[0].header
    data = b"".join(chunk.data for chunk in chunks[1:])
    if len(data) != header.nbytes:
        raise RuntimeError(f"stream ended after {len(data)} of {header.nbytes} embedding bytes")
    if isinstance(header, pb.EmbedHeader):
        shape = header.shape
    else:
        shape = (header.num_rows, header.hidden_size)
    return header, to_numpy(header.dtype, shape, data)


def _channel_options(max_send_bytes: int, max_receive_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_send_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes),
        # Large images and replies in 4 MiB HTTP/2 frames, not 16 KiB ones (about half the time for
        # a 2.5 MB request on loopback; a larger receive window measured slower).
        ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
    ]


def _preprocess_request(data, return_pixels: bool, pixel_format: str) -> pb.PreprocessRequest:
    formats = {"image": pb.PreprocessRequest.PIXEL_FORMAT_UINT8_IMAGE,
               "patches": pb.PreprocessRequest.PIXEL_FORMAT_FLOAT32_PATCHES}
    if pixel_format not in formats:
        raise ValueError(f"pixel_format is 'image' or 'patches', not {pixel_format!r}")
    return pb.PreprocessRequest(image=_as_image(data), return_pixels=return_pixels, pixel_format=formats[pixel_format])


def _count_tokens_request(data, messages, tools, thinking_effort, chat_kwargs) -> pb.CountTokensRequest:
    if (data is None) == (messages is None):
        raise ValueError("count_tokens takes either an image or messages")
    if messages is not None:
        return pb.CountTokensRequest(chat=pb.Chat(messages=messages, tools_json=_tools_json(tools),
                                                  thinking_effort=thinking_effort,
                                                  chat_kwargs_json=_kwargs_json(chat_kwargs)))
    return pb.CountTokensRequest(image=_as_image(data))


def embed_request(data: bytes | pb.Image, dtype: str = "float32") -> pb.EmbedRequest:
    """The EmbedRequest `embed` sends (a caller that checks its size first builds it once and sends
    it with `AsyncVisionClient.send_embed`)."""
    return pb.EmbedRequest(image=_as_image(data), dtype=dtype)


def generate_request(messages, tools, thinking_effort, max_new_tokens, sampling, chat_kwargs) -> pb.GenerateRequest:
    """The GenerateRequest `generate` sends (a caller that checks its size first builds it once and
    sends it with `AsyncVisionClient.send_generate`)."""
    return pb.GenerateRequest(messages=messages, tools_json=_tools_json(tools), thinking_effort=thinking_effort,
                              max_new_tokens=max_new_tokens, chat_kwargs_json=_kwargs_json(chat_kwargs),
                              sampling=pb.Sampling(**(sampling or {})))


def _encode_request(messages, tools, thinking_effort, chat_kwargs, dtype, export_vllm_ec) -> pb.EncodeRequest:
    return pb.EncodeRequest(messages=messages, tools_json=_tools_json(tools), thinking_effort=thinking_effort,
                            chat_kwargs_json=_kwargs_json(chat_kwargs), dtype=dtype, export_vllm_ec=export_vllm_ec)


class VisionClient:
    """Blocking client. `timeout` (seconds) is the default deadline of every call."""

    def __init__(self, target: str, *, timeout: float | None = None, max_send_bytes: int = DEFAULT_MAX_SEND_BYTES,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        options = _channel_options(max_send_bytes, max_receive_bytes)
        self.channel = (grpc.secure_channel(target, credentials, options=options) if credentials
                        else grpc.insecure_channel(target, options=options))
        self.stub = pb_grpc.VisionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> VisionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def health(self, service: str = SERVICE_NAME, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name: "SERVING" or "NOT_SERVING"."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        """The server's model identity (`fingerprint`), embedding width, components and devices."""
        return self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout))

    def preprocess(self, data: bytes | pb.Image, *, return_pixels: bool = False, pixel_format: str = "image",
                   timeout: float | None = None) -> pb.PreprocessResponse:
        """`pixel_format`: "image" (uint8 padded HxWx3) or "patches" (float32 [N, 3, 14, 14])."""
        req = _preprocess_request(data, return_pixels, pixel_format)
        return self.stub.Preprocess(req, timeout=self._t(timeout))

    def count_tokens(self, data: bytes | pb.Image | None = None, *, messages: list[pb.ChatMessage] | None = None,
                     tools: list[dict] | str | None = None, thinking_effort: str = "", chat_kwargs: dict | None = None,
                     timeout: float | None = None) -> pb.CountTokensResponse:
        req = _count_tokens_request(data, messages, tools, thinking_effort, chat_kwargs)
        return self.stub.CountTokens(req, timeout=self._t(timeout))

    def embed(self, data: bytes | pb.Image, *, dtype: str = "float32",
              timeout: float | None = None) -> tuple[pb.EmbedHeader, np.ndarray]:
        return _collect(list(self.stub.Embed(embed_request(data, dtype), timeout=self._t(timeout))))

    def generate(self, messages: list[pb.ChatMessage], *, tools: list[dict] | str | None = None,
                 thinking_effort: str = "", max_new_tokens: int = 0, sampling: dict | None = None,
                 chat_kwargs: dict | None = None, timeout: float | None = None) -> Iterator[pb.GenerateEvent]:
        """Stream of events; each reply (`index`) ends with its `finish`. `sampling`: the `Sampling` fields
        (temperature, top_p, top_k, seed, stop, n, logprobs, the penalties, logit_bias, ...)."""
        req = generate_request(messages, tools, thinking_effort, max_new_tokens, sampling, chat_kwargs)
        return self.stub.Generate(req, timeout=self._t(timeout))

    def encode(self, messages: list[pb.ChatMessage], *, tools: list[dict] | str | None = None,
               thinking_effort: str = "", chat_kwargs: dict | None = None, dtype: str = "float32",
               export_vllm_ec: bool = False, timeout: float | None = None) -> Encoded:
        req = _encode_request(messages, tools, thinking_effort, chat_kwargs, dtype, export_vllm_ec)
        return Encoded(*_collect(list(self.stub.Encode(req, timeout=self._t(timeout)))))


class AsyncVisionClient:
    """asyncio client (grpc.aio); the same methods as `VisionClient`, awaited, and `send_embed` /
    `send_generate`, which send a request built beforehand (`embed_request`, `generate_request`:
    one whose size the caller checked, built once)."""

    def __init__(self, target: str, *, timeout: float | None = None, max_send_bytes: int = DEFAULT_MAX_SEND_BYTES,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        options = _channel_options(max_send_bytes, max_receive_bytes)
        self.channel = (grpc.aio.secure_channel(target, credentials, options=options) if credentials
                        else grpc.aio.insecure_channel(target, options=options))
        self.stub = pb_grpc.VisionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self) -> AsyncVisionClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def health(self, service: str = SERVICE_NAME, timeout: float | None = None) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._t(timeout))

    async def preprocess(self, data: bytes | pb.Image, *, return_pixels: bool = False, pixel_format: str = "image",
                         timeout: float | None = None) -> pb.PreprocessResponse:
        req = _preprocess_request(data, return_pixels, pixel_format)
        return await self.stub.Preprocess(req, timeout=self._t(timeout))

    async def count_tokens(self, data: bytes | pb.Image | None = None, *,
                           messages: list[pb.ChatMessage] | None = None, tools: list[dict] | str | None = None,
                           thinking_effort: str = "", chat_kwargs: dict | None = None,
                           timeout: float | None = None) -> pb.CountTokensResponse:
        req = _count_tokens_request(data, messages, tools, thinking_effort, chat_kwargs)
        return await self.stub.CountTokens(req, timeout=self._t(timeout))

    async def embed(self, data: bytes | pb.Image, *, dtype: str = "float32",
                    timeout: float | None = None) -> tuple[pb.EmbedHeader, np.ndarray]:
        return await self.send_embed(embed_request(data, dtype), timeout=timeout)

    async def send_embed(self, request: pb.EmbedRequest, *,
                         timeout: float | None = None) -> tuple[pb.EmbedHeader, np.ndarray]:
        return _collect([chunk async for chunk in self.stub.Embed(request, timeout=self._t(timeout))])

    def generate(self, messages: list[pb.ChatMessage], *, tools: list[dict] | str | None = None,
                 thinking_effort: str = "", max_new_tokens: int = 0, sampling: dict | None = None,
                 chat_kwargs: dict | None = None, timeout: float | None = None) -> AsyncIterator[pb.GenerateEvent]:
        req = generate_request(messages, tools, thinking_effort, max_new_tokens, sampling, chat_kwargs)
        return self.send_generate(req, timeout=timeout)

    def send_generate(self, request: pb.GenerateRequest, *,
                      timeout: float | None = None) -> AsyncIterator[pb.GenerateEvent]:
        return self.stub.Generate(request, timeout=self._t(timeout))

    async def encode(self, messages: list[pb.ChatMessage], *, tools: list[dict] | str | None = None,
                     thinking_effort: str = "", chat_kwargs: dict | None = None, dtype: str = "float32",
                     export_vllm_ec: bool = False, timeout: float | None = None) -> Encoded:
        req = _encode_request(messages, tools, thinking_effort, chat_kwargs, dtype, export_vllm_ec)
        return Encoded(*_collect([chunk async for chunk in self.stub.Encode(req, timeout=self._t(timeout))]))
