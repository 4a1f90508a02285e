"""`sglang.grpc.encoder.SglangEncoder` on the main gRPC port: what SGLang 0.5.23's language side
calls for a `grpc://` encoder URL (`--encoder-urls grpc://host:port`, its `MMReceiverGrpc` and the
registration of its scheduler ranks). The messages, the servicer base and the registration are
those the `smg-grpc-proto` package generated from SGLang's proto, the package SGLang's own client
imports them from; nothing of that proto is copied here.

Each RPC maps its message to the body SGLang's own gRPC encoder builds from it (the JSON of its
HTTP `/encode`, image-only) and hands it to the server's one `SglangEncoder`
(`service.epd.sglang_encoder`), which the HTTP routes share: the same checks and bounds, the same
rows pushed over ZMQ, the same destination rule (`--epd-allowed-destinations`; `peer` is the gRPC
caller's address) and the same registration table, so a rank may register by either face.

- `Encode`: one part of a request's images (`mm_items`: `data:` URLs, or `http(s)` ones with
  `--allow-remote-images`), pushed to each `embedding_port` at `prefill_host`
  (`zmq_to_tokenizer`: SGLang names one), or, with no port, to the scheduler ranks that register
  the part (`zmq_to_scheduler`); answered once the push is done with an empty `EncodeResponse`,
  as SGLang's encoder answers for its ZMQ backends.
- `SchedulerReceiveUrl`: a scheduler rank's `host:port` for a part, before or after its `Encode`.
- `Send`: SGLang's `mooncake` (RDMA) backend, not served (SGLang's language side does not use it
  with gRPC encoders either): UNIMPLEMENTED naming it, and a waiting part of it ends at once.

Every failure is the face's one mapping (`GrpcFace.failures`): a bad image or a destination not
allowed is INVALID_ARGUMENT (SGLang's own encoder answers its 400s so), and, once the part's
destination is known, the failure is pushed there too as SGLang's error `EmbeddingData`. The
RPCs pass the port's interceptors as every other (the observer, the token, the protobuf guard):
SGLang's client sends no token and speaks plaintext, so it reaches a port without either.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
from smg_grpc_proto import sglang_encoder_pb2 as pb
from smg_grpc_proto import sglang_encoder_pb2_grpc as pb_grpc

from service.epd.destinations import split_host_port
from service.epd.sglang_encoder import SglangEncoder
from service.rpc.status import abort

SGLANG_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangEncoder"].full_name
add_to_server = pb_grpc.add_SglangEncoderServicer_to_server
# The error mapping around one RPC's body (`GrpcFace.failures`).
Failures = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]


def peer_host(peer: str) -> str | None:
    """The caller's address in gRPC's peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, the
    brackets maybe percent-encoded); None for another kind of peer (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    try:
        host, _ = split_host_port(urllib.parse.unquote(rest))
    except ValueError:
        return None
    return host or None


def encode_body(request: pb.EncodeRequest) -> dict[str, Any]:
    """The request as SGLang's gRPC encoder reads it (image-only), and where to: the ports (none:
    the ranks that register the part)."""
    return {"req_id": request.req_id, "mm_items": list(request.mm_items), "modality": "IMAGE",
            "num_parts": request.num_parts, "part_idx": request.part_idx, "prefill_host": request.prefill_host,
            "embedding_port": list(request.embedding_port) or None}


class SglangEncoderService(pb_grpc.SglangEncoderServicer):
    def __init__(self, failures: Failures, encoder: SglangEncoder) -> None:
        self._failures = failures
        self._encoder = encoder

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        async with self._failures(context):
            await self._encoder.encode(encode_body(request), peer_host(context.peer()))
            return pb.EncodeResponse()

    async def SchedulerReceiveUrl(self, request: pb.SchedulerReceiveUrlRequest,
                                  context: grpc.aio.ServicerContext) -> pb.SchedulerReceiveUrlResponse:
        async with self._failures(context):
            body = {"req_id": request.req_id, "receive_count": request.receive_count,
                    "receive_url": request.receive_url}
            await self._encoder.register(body, peer_host(context.peer()))
            return pb.SchedulerReceiveUrlResponse()

    async def Send(self, request: pb.SendRequest, context: grpc.aio.ServicerContext) -> pb.SendResponse:
        await abort(context, self._encoder.refuse_mooncake({"req_id": request.req_id}, peer_host(context.peer())))
