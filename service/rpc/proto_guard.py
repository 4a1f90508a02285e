"""Malformed request bytes -> INVALID_ARGUMENT, instead of gRPC's UNKNOWN with a Python class name.

gRPC parses a request before any handler or error mapping runs, so a body that is not a valid
protobuf reaches the caller as `UNKNOWN: Unexpected <class 'google.protobuf.message.DecodeError'>`.
This interceptor moves the parse into the handler: the request (or each message of a request
stream) arrives as raw bytes, is parsed there, and a parse failure is bad input (`INVALID_ARGUMENT`
naming the method, the kind in the trailing metadata, as every refusal of the face). Valid
requests are parsed exactly once, as before. `GrpcFace` puts it on every server it starts (the
main port and the health port), last, so it covers every service there: ours, health, reflection.
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


async def _parse_each(parse: Callable[[bytes], Any], raws: AsyncIterator[bytes], method: str,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for raw in raws:
        yield await _parse(parse, raw, method, context)


def guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` taking raw bytes and parsing them itself (every shape of RPC)."""
    parse, serialize = handler.request_deserializer, handler.response_serializer
    if parse is None:
        return handler  # takes bytes already (a refusal that never reads its request)
    streaming = handler.request_streaming
    behavior = (handler.stream_stream or handler.stream_unary) if streaming else (
        handler.unary_stream or handler.unary_unary)

    async def request(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        return _parse_each(parse, raw, method, context) if streaming else await _parse(parse, raw, method, context)

    if not handler.response_streaming:
        async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await request(raw, context), context)

        make = grpc.stream_unary_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        return make(unary, None, serialize)

    make = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_stream_rpc_method_handler
    if inspect.isasyncgenfunction(behavior):

        async def stream(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for message in behavior(await request(raw, context), context):
                yield message

        return make(stream, None, serialize)

    async def writer(raw: Any, context: grpc.aio.ServicerContext) -> None:  # writes via context.write (Watch)
        await behavior(await request(raw, context), context)

    return make(writer, None, serialize)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return handler if handler is None else guarded(handler, handler_call_details.method)
