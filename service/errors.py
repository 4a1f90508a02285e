"""The service's one error taxonomy: every failure a caller can meet has a `Kind`, and one table
says what each kind means on every face: the gRPC status, the HTTP status, and what a batch job
does with it: retries it (a transient row that `--resume` runs again), records it for good, or
stops (a refused token: every other line would be refused alike).

Domain errors carry their kind as a class attribute `kind` (the `Kind` value as a string), so
`vision` and `textcore` need nothing from here: `ImageError` is bad input, `ImageTooLargeError`
too large, `UnsupportedMediaError` unsupported, `ChatError` and `SamplingError` bad input. Errors the service raises
itself are `ServiceError`s. `classify` is the single place that turns any exception into a kind and
the message a client sees; an exception with no kind is a bug (INTERNAL to a client, logged with
its traceback under a reference, and it stops a batch job).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from enum import StrEnum
from typing import NamedTuple

import grpc

from textcore.chat import ChatError
from vision.errors import ImageError, UnsupportedMediaError

log = logging.getLogger("kimi_vision.service")


class Kind(StrEnum):
    BAD_INPUT = "bad_input"  # the request is wrong (a bad image, chat or field): fix it
    TOO_LARGE = "too_large"  # over a size limit (bytes, pixels, images): send less
    UNSUPPORTED = "unsupported"  # a valid request for something not served (video)
    NOT_CONFIGURED = "not_configured"  # needs something the operator did not enable
    NOT_FOUND = "not_found"  # names something this server does not have (another model)
    UNAUTHENTICATED = "unauthenticated"  # no valid bearer token: send the right one
    OVERLOADED = "overloaded"  # the admission queue is full: retry later with backoff
    UNAVAILABLE = "unavailable"  # warming up, draining, a worker died: retry here or elsewhere
    DEADLINE = "deadline"  # the caller's deadline passed
    CANCELLED = "cancelled"  # the caller went away
    SLOW_CLIENT = "slow_client"  # the caller did not send its request (head or body) in time
    HEADERS_TOO_LARGE = "headers_too_large"  # an HTTP request line and headers over the limit
    METHOD_NOT_ALLOWED = "method_not_allowed"  # an HTTP method the route does not serve
    INTERNAL = "internal"  # a fault of the server: retry later, report if it stays


class Rule(NamedTuple):
    grpc: grpc.StatusCode
    http: int
    openai_type: str  # the `type` of OpenAI's error object
    retry: bool  # a batch job retries the item (and --resume runs it again) rather than record it
    stops: bool = False  # a batch job stops at once, with the message (no row: a resume runs the line again)
    closes: bool = False  # an HTTP answer closes the connection (what else the client sent is not a request)


_INVALID = "invalid_request_error"
RULES: dict[Kind, Rule] = {
    Kind.BAD_INPUT: Rule(grpc.StatusCode.INVALID_ARGUMENT, 400, _INVALID, False),
    Kind.TOO_LARGE: Rule(grpc.StatusCode.INVALID_ARGUMENT, 413, _INVALID, False),
    Kind.UNSUPPORTED: Rule(grpc.StatusCode.UNIMPLEMENTED, 400, _INVALID, False),
    Kind.NOT_CONFIGURED: Rule(grpc.StatusCode.FAILED_PRECONDITION, 400, _INVALID, False),
    Kind.NOT_FOUND: Rule(grpc.StatusCode.NOT_FOUND, 404, _INVALID, False),
    Kind.UNAUTHENTICATED: Rule(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", False, stops=True),
    Kind.OVERLOADED: Rule(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", True),
    Kind.UNAVAILABLE: Rule(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", True),
    Kind.DEADLINE: Rule(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", True),
    Kind.CANCELLED: Rule(grpc.StatusCode.CANCELLED, 499, "cancelled_error", True),
    Kind.SLOW_CLIENT: Rule(grpc.StatusCode.DEADLINE_EXCEEDED, 408, "timeout_error", True, closes=True),
    Kind.HEADERS_TOO_LARGE: Rule(grpc.StatusCode.INVALID_ARGUMENT, 431, _INVALID, False, closes=True),
    Kind.METHOD_NOT_ALLOWED: Rule(grpc.StatusCode.UNIMPLEMENTED, 405, _INVALID, False),
    Kind.INTERNAL: Rule(grpc.StatusCode.INTERNAL, 500, "server_error", True),
}

# What a client reads before a domain error's own message, by the error's family (first match).
_SUBJECTS: tuple[tuple[type[Exception], str], ...] = (
    (UnsupportedMediaError, ""),
    (ImageError, "bad image: "),
    (ChatError, "bad chat: "),
)


class ServiceError(Exception):
    """A failure the service reports with a kind of its own choosing."""

    kind = Kind.INTERNAL


class BadRequest(ServiceError):
    """The request is malformed (a bad field, an unknown option)."""

    kind = Kind.BAD_INPUT


class TooLarge(ServiceError):
    """The request breaks a size limit (too many images, too many pixels in all)."""

    kind = Kind.TOO_LARGE


class Unsupported(ServiceError):
    """A valid request for something this server does not do (video, a media type it does not know)."""

    kind = Kind.UNSUPPORTED


class NotConfigured(ServiceError):
    """The request needs something the operator did not enable (an export directory, the trunk)."""

    kind = Kind.NOT_CONFIGURED


class NotFound(ServiceError):
    """The request names something this server does not have (a model it does not serve)."""

    kind = Kind.NOT_FOUND


class Unauthenticated(ServiceError):
    """The request carries no valid bearer token (missing, malformed, sent twice, or wrong)."""

    kind = Kind.UNAUTHENTICATED


class Overloaded(ServiceError):
    """The admission queue is full; retry later with backoff."""

    kind = Kind.OVERLOADED


class Unavailable(ServiceError):
    """Warming up, draining, or a worker died mid-request; safe to retry elsewhere or later."""

    kind = Kind.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    kind = Kind.DEADLINE


class ClientGone(ServiceError):
    """The caller went away before the answer (an HTTP client closed its connection)."""

    kind = Kind.CANCELLED


class SlowClient(ServiceError):
    """The caller did not send its request line and headers, or its body, within the timeout."""

    kind = Kind.SLOW_CLIENT


class HeadersTooLarge(ServiceError):
    kind = Kind.HEADERS_TOO_LARGE


class MethodNotAllowed(ServiceError):
    kind = Kind.METHOD_NOT_ALLOWED


class Failure(NamedTuple):
    """A classified failure: its kind and the message a client (or a batch row) shows."""

    kind: Kind
    message: str

    @property
    def rule(self) -> Rule:
        return RULES[self.kind]


def classify(exc: BaseException) -> Failure | None:
    """The kind and client-facing message of a known failure; None for a bug."""
    if isinstance(exc, TimeoutError):
        return Failure(Kind.DEADLINE, str(exc) or "deadline exceeded")
    if isinstance(exc, asyncio.CancelledError):
        return Failure(Kind.CANCELLED, "cancelled")
    kind = getattr(exc, "kind", None)
    if kind is None:
        return None
    subject = next((prefix for family, prefix in _SUBJECTS if isinstance(exc, family)), "")
    return Failure(Kind(kind), f"{subject}{exc}")


def failure_for(exc: BaseException) -> Failure:
    """`classify`, with a bug reported as INTERNAL under a reference that the server log carries
    with the traceback (the client never sees internals)."""
    failure = classify(exc)
    if failure is not None:
        return failure
    ref = uuid.uuid4().hex[:12]
    log.error("internal error (ref %s)", ref, exc_info=exc)
    return Failure(Kind.INTERNAL, f"internal error (ref {ref}; details in the server log)")


def kind_of_grpc(code: grpc.StatusCode) -> Kind:
    """The kind a gRPC status stands for (the first kind the table maps to it; UNKNOWN and other
    codes no rule names count as INTERNAL)."""
    return next((kind for kind, rule in RULES.items() if rule.grpc == code), Kind.INTERNAL)


# The trailing metadata key under which a server names a failure's kind: several kinds share a
# status code (bad input and too large are both INVALID_ARGUMENT), and a client that reports the
# HTTP status (a batch row) needs the kind itself.
KIND_METADATA = "kimi-vision-kind"


class RemoteError(ServiceError):
    """A failure a server reported over gRPC; its kind is the one the server named (`kind`, from
    the trailing metadata) when that kind has this status code, else the one its code stands for."""

    def __init__(self, code: grpc.StatusCode, details: str, kind: str | None = None) -> None:
        named = Kind(kind) if kind in set(Kind) else None
        self.kind = named if named is not None and RULES[named].grpc == code else kind_of_grpc(code)
        # A retryable status says what happened to the call; a final one carries the server's
        # message, worded as the engine words it ("bad image: ..."), so rows read the same either way.
        super().__init__(f"server {code.name}: {details}" if RULES[self.kind].retry else details or code.name)
