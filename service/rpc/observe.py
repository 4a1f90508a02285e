"""What the server records of every RPC: the gRPC metrics, one access-log line, the request id and,
when tracing is on, the RPC's span. The outermost interceptor, so refusals (a missing token, a
request that is not protobuf) are recorded too.

Request id: the caller's `x-request-id` metadata (a plain token, see `service.logs.request_id`),
else a new one; it comes back in the trailing metadata and is on every log line of the call.

Logged: method, peer address, final status code, duration, the sizes of what came in and went out,
and the request id. Never logged: any message content (image bytes, prompt text, token ids,
embeddings), any other metadata value (the `authorization` header above all), or the status
details (error messages can quote a caller's input). Health checks are not logged unless asked
(`--log-health-checks`): a probe every few seconds would drown the rest. tests/test_security.py
holds the server to this with real requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from service import tracing
from service.logs import REQUEST_ID, log_access, request_id
from service.metrics import Metrics

log = logging.getLogger("kimi_vision.access")

HEALTH_METHODS = "/grpc.health.v1.Health/"
REQUEST_ID_KEY = "x-request-id"
# gRPC cancels a handler when its deadline passes; a cancellation this close to the deadline is that.
DEADLINE_SLACK_S = 0.05


def _size(message: Any) -> int:
    return message.ByteSize() if hasattr(message, "ByteSize") else len(message or b"")


def _grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "bidi_stream" if handler.response_streaming else "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _code(error: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status the call ended with."""
    if error is None or isinstance(error, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        deadline_hit = remaining is not None and remaining < DEADLINE_SLACK_S
        return grpc.StatusCode.DEADLINE_EXCEEDED if deadline_hit else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what gRPC answers for an exception a handler let out


class _Rpc:
    """One call being observed; `response_bytes` grows as a stream is sent (None: not counted)."""

    def __init__(self, method: str, grpc_type: str, metadata: Any, request_bytes: int | None) -> None:
        self.method = method
        self.grpc_type = grpc_type
        self.service, _, self.name = method.lstrip("/").partition("/")
        self.metadata = {key: value for key, value in metadata or () if isinstance(value, str)}
        self.request_id = request_id(self.metadata.get(REQUEST_ID_KEY))
        self.request_bytes = request_bytes
        self.response_bytes: int | None = None
        self.start = time.perf_counter()
        self.peer = "?"


class RpcObserver(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics, *, log_health_checks: bool = False, logger: logging.Logger = log) -> None:
        self._metrics = metrics
        self._log_health_checks = log_health_checks
        self._log = logger

    @contextlib.contextmanager
    def _observe(self, rpc: _Rpc, context: grpc.aio.ServicerContext) -> Iterator[_Rpc]:
        REQUEST_ID.set(rpc.request_id)  # this call's task only (no reset needed: the task ends with the call)
        # Read while the call is surely alive: grpc.aio's peer() on a call its deadline or the client
        # has just ended could crash the process (seen as a segfault in _end).
        rpc.peer = context.peer()
        context.set_trailing_metadata(((REQUEST_ID_KEY, rpc.request_id),))
        self._metrics.grpc_start(rpc.grpc_type, rpc.service, rpc.name)
        health = rpc.method.startswith(HEALTH_METHODS)
        span = contextlib.nullcontext() if health else tracing.span(
            f"{rpc.service}/{rpc.name}", carrier=rpc.metadata, **{"rpc.system": "grpc", "rpc.service": rpc.service,
                                                                  "rpc.method": rpc.name,
                                                                  "kimi_vision.request_id": rpc.request_id})
        error: BaseException | None = None
        with span as current:
            try:
                yield rpc
            except BaseException as exc:
                error = exc
                raise
            finally:
                code = _code(error, context)
                if current is not None:
                    current.set_attribute("rpc.grpc.status_code", code.value[0])
                self._end(rpc, code, context, logged=self._log_health_checks or not health)

    def _end(self, rpc: _Rpc, code: grpc.StatusCode, context: grpc.aio.ServicerContext, *, logged: bool) -> None:
        seconds = time.perf_counter() - rpc.start
        self._metrics.grpc_end(rpc.grpc_type, rpc.service, rpc.name, code, seconds)
        if not logged:
            return
        log_access(self._log, request_id=rpc.request_id, method=rpc.method, peer=rpc.peer, status_name="code",
                   status=code.name, seconds=seconds, request_bytes=rpc.request_bytes,
                   response_bytes=rpc.response_bytes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler  # an unknown method: gRPC answers UNIMPLEMENTED
        method, grpc_type, metadata = details.method, _grpc_type(handler), details.invocation_metadata
        observe = self._observe
        args = (handler.request_deserializer, handler.response_serializer)

        if handler.unary_unary or handler.stream_unary:
            behavior = handler.unary_unary or handler.stream_unary
            sized = handler.unary_unary is not None  # a request stream's size is not counted

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with observe(_Rpc(method, grpc_type, metadata, _size(request) if sized else None), context) as rpc:
                    response = await behavior(request, context)
                    rpc.response_bytes = _size(response)
                    return response

            make = grpc.unary_unary_rpc_method_handler if sized else grpc.stream_unary_rpc_method_handler
            return make(unary, *args)

        behavior = handler.unary_stream or handler.stream_stream
        sized = handler.unary_stream is not None
        make = grpc.unary_stream_rpc_method_handler if sized else grpc.stream_stream_rpc_method_handler
        if not inspect.isasyncgenfunction(behavior):  # writes with context.write (health Watch, reflection)

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                with observe(_Rpc(method, grpc_type, metadata, _size(request) if sized else None), context):
                    await behavior(request, context)

            return make(writer, *args)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with observe(_Rpc(method, grpc_type, metadata, _size(request) if sized else None), context) as rpc:
                rpc.response_bytes = 0
                async for message in behavior(request, context):
                    rpc.response_bytes += _size(message)
                    yield message

        return make(stream, *args)
