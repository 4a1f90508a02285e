"""How the gRPC face ends a call with a failure (`abort`): the handlers' error mapping
(`GrpcFace.call`), the token's refusal (`auth`) and the protobuf guard's (`proto_guard`) alike.
Apart from the package's `__init__` so that the client does not import the error taxonomy."""

from __future__ import annotations

from typing import NoReturn

import grpc

from service import errors


async def abort(context: grpc.aio.ServicerContext, failure: errors.Failure) -> NoReturn:
    """End the call with `failure` as the error taxonomy maps it: its status and message, and its
    kind beside what the call's trailing metadata already holds (its request id): several kinds
    share a status code, and a batch row reports the kind's HTTP status."""
    trailing = (*(context.trailing_metadata() or ()), (errors.KIND_METADATA, failure.kind.value))
    await context.abort(failure.rule.grpc, failure.message, trailing_metadata=trailing)
