"""Optional bearer-token authentication for the gRPC server, and the client side of it.

Server: `BearerTokenInterceptor(token)` is a grpc.aio server interceptor. Every RPC must carry
the metadata `authorization: Bearer <token>`; anything else is answered as the error taxonomy
answers an unauthenticated request (`UNAUTHENTICATED`, the kind in the trailing metadata, a log
line with the request id saying why) before the request reaches a handler (unknown methods too,
so a caller without the token learns nothing about the API). `grpc.health.v1.Health` stays
open: load balancers and orchestrators probe health without credentials.

Client: the token travels as call credentials, which gRPC only attaches to a secure channel.
`bearer_credentials(token, root_certificates=...)` gives TLS + token; without certificates it
gives gRPC's local (loopback, plaintext) credentials + token, for a server without TLS on
127.0.0.1. `auth_metadata(token)` is the raw metadata, for stubs called with `metadata=`.

The token itself (where it comes from, how it is compared) is `service.auth`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc

from service import errors
from service.auth import BearerToken
from service.rpc.status import abort

HEALTH_SERVICE = "grpc.health.v1.Health"

log = logging.getLogger("kimi_vision.auth")


def _service_of(method: str) -> str:
    # "/kimi.vision.v1.VisionService/Embed" -> "kimi.vision.v1.VisionService"
    return method.lstrip("/").partition("/")[0]


def _authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[str | bytes]:
    return [value for key, value in (metadata or ()) if key == "authorization"]


def _deny_handler(handler: grpc.RpcMethodHandler | None, method: str,
                  refusal: errors.Unauthenticated) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers the refusal as the error taxonomy
    maps it, without touching the request (no deserializer: an unauthenticated request is never
    parsed). It runs inside the observer's call, so its log line carries the request id."""
    failure = errors.failure_for(refusal)

    async def unary(_request: object, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s: %s", method, failure.message)
        await abort(context, failure)

    async def stream(request: object, context: grpc.aio.ServicerContext):  # async generator
        await unary(request, context)
        yield  # pragma: no cover - abort raises

    if handler is None or handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.stream_stream_rpc_method_handler(stream)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Require `authorization: Bearer <token>` on every RPC except those of `exempt` services."""

    def __init__(self, token: str, *, exempt_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        self._token = BearerToken(token)
        self._exempt = frozenset(exempt_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if _service_of(method) in self._exempt:
            return await continuation(handler_call_details)
        refusal = self._token.refusal(_authorization(handler_call_details.invocation_metadata))
        if refusal is None:
            return await continuation(handler_call_details)
        return _deny_handler(await continuation(handler_call_details), method, refusal)


# ---------------------------------------------------------------------------------------------
# Client side


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata for one call: `stub.Method(request, metadata=auth_metadata(token))`."""
    return (("authorization", f"Bearer {token}"),)


def bearer_credentials(token: str, *, root_certificates: bytes | None = None,
                       tls: bool | None = None) -> grpc.ChannelCredentials:
    """Channel credentials that send `token` on every call (for `VisionClient(credentials=...)`).

    With TLS (`root_certificates` given, or `tls=True` to trust the system roots) the token rides
    on an encrypted channel. Without TLS, gRPC's local credentials are used: plaintext, allowed
    only to loopback addresses (127.0.0.1, ::1), where a token needs no encryption.
    """
    use_tls = root_certificates is not None if tls is None else tls
    call = grpc.access_token_call_credentials(token)
    channel = (grpc.ssl_channel_credentials(root_certificates) if use_tls
               else grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP))
    return grpc.composite_channel_credentials(channel, call)
