"""`kimi.vision.v1.VisionService`: each RPC converts its request, calls the engine once, and
converts the answer. Admission, the serving state and the error mapping wrap every call
(`GrpcFace.call`, which hands the handler the engine)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import grpc

from service.engine import Engine
from service.engine.store import item_keys
from service.epd.vllm_storage import VllmStorageSink
from service.errors import BadRequest
from service.rpc import convert
from service.rpc._proto import vision_pb2 as pb
from service.rpc._proto import vision_pb2_grpc as pb_grpc
from textcore.tokenizer import MEDIA_PAD_ID
from vision.options import DEFAULT_OPTIONS

# Admission and the error mapping around one RPC's body, yielding the engine (`GrpcFace.call`;
# `generation=True` for Generate, which the trunk's scheduler bounds instead of a work slot).
Call = Callable[..., AbstractAsyncContextManager[Engine]]


class VisionService(pb_grpc.VisionServiceServicer):
    def __init__(self, call: Call, max_message_bytes: int) -> None:
        self._call = call
        self._max_message_bytes = max_message_bytes  # the face's receive limit (GetModelInfo reports it)

    async def Preprocess(self, request: pb.PreprocessRequest,
                         context: grpc.aio.ServicerContext) -> pb.PreprocessResponse:
        async with self._call(context) as engine:
            pre = await engine.preprocess(convert.media_input(request.image))
            reply = pb.PreprocessResponse(
                orig_width=pre.orig_size[0], orig_height=pre.orig_size[1], width=pre.size[0], height=pre.size[1],
                padded_width=pre.padded_size[0], padded_height=pre.padded_size[1], grid_thw=list(pre.grid_thw),
                num_tokens=pre.num_tokens, prompt=pre.prompt,
            )
            if request.return_pixels:
                patches = request.pixel_format == pb.PreprocessRequest.PIXEL_FORMAT_FLOAT32_PATCHES
                reply.pixel_values.CopyFrom(await engine.run_cpu(convert.pixels_tensor, pre, patches))
            return reply

    async def CountTokens(self, request: pb.CountTokensRequest,
                          context: grpc.aio.ServicerContext) -> pb.CountTokensResponse:
        async with self._call(context) as engine:
            which = request.WhichOneof("input")
            if which == "image":
                media = [convert.media_input(request.image)]
                (n,) = (await engine.prepare(engine.check(media), media)).media_tokens
                return pb.CountTokensResponse(num_tokens=n, image_tokens=[n])
            if which == "chat":
                c = request.chat
                chat, media = convert.chat_input(c.messages, c.tools_json, c.thinking_effort, c.chat_kwargs_json)
                prepared = await engine.prepare(engine.check(media, chat), media, chat)
                total, media_tokens = len(prepared.prompt.ids), prepared.media_tokens
                return pb.CountTokensResponse(num_tokens=total, image_tokens=media_tokens,
                                              text_tokens=total - sum(media_tokens))
            raise BadRequest("CountTokens needs an image or a chat")

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EmbedChunk]:
        async with self._call(context) as engine:
            dtype = convert.out_dtype(request.dtype)
            (emb,) = await engine.embed([convert.media_input(request.image)])
            data = await engine.run_cpu(convert.tensor_bytes, emb.rows, dtype)
            yield pb.EmbedChunk(header=pb.EmbedHeader(
                num_tokens=emb.num_tokens, hidden_size=emb.rows.shape[1], dtype=dtype, shape=list(emb.rows.shape),
                grid_thw=list(emb.grid_thw), prompt=emb.prompt, content_hash=emb.content_hash, nbytes=len(data),
                cached=emb.cached,
            ))
            for piece in convert.chunks(data):
                yield pb.EmbedChunk(data=bytes(piece))

    async def Encode(self, request: pb.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EncodeChunk]:
        async with self._call(context) as engine:
            dtype = convert.out_dtype(request.dtype)
            chat, media = convert.chat_input(request.messages, request.tools_json, request.thinking_effort,
                                             request.chat_kwargs_json)
            checked = engine.check(media, chat)
            # vLLM's key of every item, its uuid checked before any pixel is encoded (hashing the
            # bytes: off the event loop); with export_vllm_ec, its file too (the export directory is set).
            vllm = VllmStorageSink.of(engine) if request.export_vllm_ec else None
            if vllm is not None:
                item_ids = await engine.run_cpu(vllm.keys, media)
            else:
                item_ids = await engine.run_cpu(item_keys, media, engine.model_id, engine.config.hash_algorithm)
            encoding = await engine.encode(await engine.prepare(checked, media, chat))
            keys, paths = [k.key for k in item_ids], [""] * len(media)
            if vllm is not None:
                paths = (await vllm.deliver(engine, encoding, item_ids)).locations
            rows = [e.rows for e in encoding.embeddings]
            data = b"".join([await engine.run_cpu(convert.tensor_bytes, r, dtype) for r in rows])
            yield pb.EncodeChunk(header=pb.EncodeHeader(
                input_ids=encoding.input_ids, position_ids=encoding.position_ids, hidden_size=engine.hidden_size,
                dtype=dtype, num_rows=sum(e.num_tokens for e in encoding.embeddings), nbytes=len(data),
                media_pad_id=MEDIA_PAD_ID,
                spans=[pb.ImageSpan(offset=s.offset, length=s.length, content_hash=e.content_hash,
                                    grid_thw=list(e.grid_thw), ec_path=path, mm_hash=key)
                       for s, e, path, key in zip(encoding.spans, encoding.embeddings, paths, keys, strict=True)],
            ))
            for piece in convert.chunks(data):
                yield pb.EncodeChunk(data=bytes(piece))

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:
        async with self._call(context, generation=True) as engine:
            chat, media = convert.chat_input(request.messages, request.tools_json, request.thinking_effort,
                                             request.chat_kwargs_json)
            checked = engine.check(media, chat, convert.sampling(request))
            prepared = await engine.prepare(checked, media, chat)
            # aclosing: leaving early (cancelled, deadline) closes the generation at once, which
            # stops the trunk at its next token.
            async with contextlib.aclosing(engine.generate(prepared)) as items:
                async for item in items:
                    message = convert.event(item)
                    if message is not None:
                        yield message

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        async with self._call(context) as engine:
            return pb.ModelInfo(fingerprint=engine.fingerprint, hidden_size=engine.hidden_size,
                                components=engine.config.components, devices=engine.devices,
                                image_options=DEFAULT_OPTIONS.key(), model_id=engine.model_id,
                                served_model_names=engine.served_model_names,
                                hash_algorithm=engine.config.hash_algorithm,
                                max_image_bytes=engine.config.limits.max_bytes,
                                max_image_pixels=engine.config.limits.max_pixels,
                                max_message_bytes=self._max_message_bytes)
