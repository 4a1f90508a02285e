"""One access-log line per RPC, and the policy of what it may contain.

Logged: method, peer address, final status code, duration, and the sizes of what came in and
went out. Never logged: any message content (image bytes, prompt text, token ids, embeddings),
any metadata value (the `authorization` header above all), or the status details (error
messages can quote a caller's input). An operator who needs more turns on the metrics, not the
log. tests/test_security.py holds the server to this with real requests.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger("kimi_vision.access")


def _size(message: Any) -> int:
    return message.ByteSize() if hasattr(message, "ByteSize") else len(message or b"")


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs `method peer code ms in=<bytes> out=<bytes>` when each RPC ends (INFO; errors too)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger

    def _emit(self, method: str, context: grpc.aio.ServicerContext, code: grpc.StatusCode | None, start: float,
              size_in: int, size_out: int | None) -> None:
        code = code or context.code() or grpc.StatusCode.OK
        self._log.info("%s peer=%s code=%s ms=%.1f in=%d out=%s", method, context.peer(), code.name,
                       (time.perf_counter() - start) * 1e3, size_in, "?" if size_out is None else size_out)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED) or a streaming upload (reflection)
        method = handler_call_details.method
        emit = self._emit

        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, code, response = time.perf_counter(), None, None
                try:
                    response = await behavior(request, context)
                    return response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except grpc.aio.AbortError:
                    raise
                except Exception:
                    code = grpc.StatusCode.UNKNOWN
                    raise
                finally:
                    emit(method, context, code, start, _size(request), _size(response))

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)

        behavior = handler.unary_stream
        if not inspect.isasyncgenfunction(behavior):  # writes with context.write (health Watch)

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                start, code = time.perf_counter(), None
                try:
                    await behavior(request, context)
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                finally:
                    emit(method, context, code, start, _size(request), None)  # written via context.write

            return grpc.unary_stream_rpc_method_handler(writer, handler.request_deserializer,
                                                        handler.response_serializer)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start, code, sent = time.perf_counter(), None, 0
            try:
                async for message in behavior(request, context):
                    sent += _size(message)
                    yield message
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:
                raise
            except Exception:
                code = grpc.StatusCode.UNKNOWN
                raise
            finally:
                emit(method, context, code, start, _size(request), sent)

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                    handler.response_serializer)
