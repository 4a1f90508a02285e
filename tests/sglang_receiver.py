"""The language side of SGLang 0.5.23's encoder disaggregation, for tests: SGLang's own receiver
code (its EmbeddingData and MultiModalEmbeddingData, the part validation and the allow-listed
unpickler), imported from its released wheel (fetched and sha256-checked by `peers`; the module is
skipped when it cannot be downloaded), fed by real ZMQ PULL sockets on 127.0.0.1 as SGLang's
tokenizer (`zmq_to_tokenizer`) and its scheduler ranks (`zmq_to_scheduler`) bind them.

`receive` takes one request's parts off a socket step for step as SGLang does it
(`MMReceiverBase._recv_mm_data` and `WaitingMMRequestBase.consume_parts`, methods of classes that
need SGLang's running scheduler and tokenizer): unpickle the first frame with `safe_pickle_loads`,
drop a part of another request, fail on an error part, read the rows from the second frame with
the part's dtype and shape, aggregate until every part is in.
"""

from __future__ import annotations

import os
import warnings

import peers
import torch
import zmq

SGLANG_VERSION = peers.SGLANG_VERSION
WHEEL = peers.sglang_importable()  # skips the importing test module when offline

# SGLang's package import points third-party JIT caches (Triton's, Inductor's, ...) at its own
# directory through os.environ, and its layers warn that they need a GPU: neither is the tests'.
_environ = dict(os.environ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.disaggregation.encoder import receiver  # SGLang's, from its wheel
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.utils.common import safe_pickle_loads
for _key in set(os.environ) - set(_environ):
    del os.environ[_key]
os.environ.update(_environ)
del _environ

MODEL_TYPE = "kimi_k3"  # what SGLang's receiver reads off Kimi-K3's config (model_type)

__all__ = ["Modality", "bound_pull", "receive", "receiver", "safe_pickle_loads"]


def bound_pull(context: zmq.Context) -> tuple[zmq.Socket, int]:
    """A PULL socket on a free 127.0.0.1 port, as SGLang's `get_zmq_socket_on_host` makes one."""
    sock = context.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, port


def receive(sock: zmq.Socket, req_id: str,
            timeout_s: float) -> receiver.MultiModalEmbeddingData | receiver.EmbeddingData:
    """Every part of request `req_id` (the aggregate), or the first error part; AssertionError when
    nothing arrives within `timeout_s` of the last message."""
    aggregate = None
    while aggregate is None or not aggregate.ready:
        assert sock.poll(int(timeout_s * 1000)), f"no embedding message for {req_id} within {timeout_s} s"
        parts = sock.recv_multipart(copy=False)
        recv_obj = safe_pickle_loads(parts[0])
        if not receiver._embedding_part_matches_request(recv_obj, req_id):
            continue
        if getattr(recv_obj, "error_msg", None) is not None:
            return recv_obj
        assert len(parts) == 2, f"an embedding message has 2 frames, got {len(parts)}"
        buffer = parts[1].buffer if hasattr(parts[1], "buffer") else parts[1]
        recv_obj.embedding = torch.frombuffer(buffer, dtype=recv_obj.dtype).reshape(recv_obj.shape).clone()
        aggregate = receiver._aggregate_embedding_part(aggregate, recv_obj, MODEL_TYPE)
    return aggregate
