"""Malformed request bytes -> INVALID_ARGUMENT, instead of gRPC's UNKNOWN with a Python class name.

gRPC parses a request before any handler or error mapping runs, so a body that is not a valid
protobuf reaches the caller as `UNKNOWN: Unexpected <class 'google.protobuf.message.DecodeError'>`.
This interceptor moves the parse into the handler: the request arrives as raw bytes, is parsed
there, and a parse failure is bad input (`INVALID_ARGUMENT` naming the method, the kind in the
trailing metadata, as every refusal of the face). Valid requests are parsed exactly once, as before.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.errors import Failure, Kind
from service.rpc.status import abort


async def _parse(parse: Callable[[bytes], Any], raw: bytes, method: str, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except Exception:  # noqa: BLE001 - DecodeError and friends: the bytes are the caller's problem
        await abort(context, Failure(Kind.BAD_INPUT, f"the request to {method} is not a valid protobuf message of "
                                                     f"its type ({len(raw)} bytes)"))


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await _parse(parse, raw, method, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)

        behavior = handler.unary_stream
        if inspect.isasyncgenfunction(behavior):

            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for message in behavior(await _parse(parse, raw, method, context), context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)

        async def writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:  # writes via context.write
            await behavior(await _parse(parse, raw, method, context), context)

        return grpc.unary_stream_rpc_method_handler(writer, None, handler.response_serializer)
