"""The service's one error taxonomy and its mapping to gRPC status codes.

Handlers raise either a `ServiceError` subclass or let a domain error (bad image, dead worker,
bad chat) escape; `status_for` is the single place that turns any exception into the status a
client sees. Messages name the problem; tracebacks stay in the server log.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

log = logging.getLogger("kimi_vision.service")


class ServiceError(Exception):
    """An error the client caused or must react to; `code` is what it sees."""

    code = grpc.StatusCode.INTERNAL


class BadRequest(ServiceError):
    """The request is malformed or breaks a limit (bad field, too many images, too large)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unsupported(ServiceError):
    """A valid request for something this server does not do (video, unknown dtype kinds)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Overloaded(ServiceError):
    """The admission queue is full; retry later with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Warming up, draining, or a worker died mid-request; safe to retry elsewhere or later."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotConfigured(ServiceError):
    """The request needs something the operator did not enable (e.g. an export directory)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def _domain_status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    # Imported here so `service.errors` stays light for clients; by the time a handler fails,
    # the server has imported all of these anyway.
    from service.splice import SpliceError
    from textcore.chat import ChatError
    from vision.errors import ImageError, UnsupportedMediaError
    from vision.pool import PoolClosedError, WorkerDiedError

    if isinstance(exc, UnsupportedMediaError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, ImageError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"bad image: {exc}"
    if isinstance(exc, ChatError | SpliceError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"bad chat: {exc}"
    if isinstance(exc, WorkerDiedError):
        return grpc.StatusCode.UNAVAILABLE, f"encoder worker died; retry: {exc}"
    if isinstance(exc, PoolClosedError):
        return grpc.StatusCode.UNAVAILABLE, "no encoder worker is available on this server; retry elsewhere"
    return None


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception raised while serving."""
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    mapped = _domain_status(exc)
    if mapped is not None:
        return mapped
    ref = uuid.uuid4().hex[:12]
    log.error("internal error (ref %s)", ref, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (ref {ref}; details in the server log)"
