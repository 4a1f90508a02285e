"""The language side of SGLang 0.5.23's encoder disaggregation, for tests: SGLang's own receiver
code (its EmbeddingData and MultiModalEmbeddingData, the part validation and the allow-listed
unpickler), imported from its released wheel (fetched and sha256-checked by `peers`; the module is
skipped when it cannot be downloaded), fed by real ZMQ PULL sockets on 127.0.0.1 as SGLang's
tokenizer (`zmq_to_tokenizer`) and its scheduler ranks (`zmq_to_scheduler`) bind them.

`expected_rows` is what each image's rows must be (the Embed RPC's), `check_rows` holds a received
request to them. `receive` takes one request's parts off a socket step for step as SGLang does it
(`MMReceiverBase._recv_mm_data` and `WaitingMMRequestBase.consume_parts`, methods of classes that
need SGLang's running scheduler and tokenizer): unpickle the first frame with `safe_pickle_loads`,
drop a part of another request, fail on an error part, read the rows from the second frame with
the part's dtype and shape, aggregate until every part is in.
"""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import peers
import torch
import zmq
from PIL import Image

from service.rpc.client import VisionClient

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
MERGE = (2, 2)  # Kimi-K3's vision_config.merge_kernel_size: SGLang's K3 processor counts h * w / 4 tokens per grid
# One image's expected rows (bfloat16 as raw 16-bit words), grid [t, h, w] and original [width, height].
Expected = tuple[np.ndarray, list[int], list[int]]

__all__ = ["Modality", "bound_pull", "check_rows", "expected_rows", "receive", "receiver", "safe_pickle_loads"]


def expected_rows(target: str, images: list[bytes]) -> list[Expected]:
    """Each image's bfloat16 rows, grid and original size, from the gRPC face's Embed at `target`."""
    out = []
    with VisionClient(target, timeout=120) as rpc:
        for data in images:
            header, rows = rpc.embed(data, dtype="bfloat16")
            words = (rows.view(np.uint32) >> 16).astype(np.uint16)  # the RPC widened bf16 to f32 exactly
            out.append((words, list(header.grid_thw), list(Image.open(io.BytesIO(data)).size)))
    return out


def check_rows(aggregate, indices: list[int], expected: list[Expected]) -> torch.Tensor:
    """The request's rows, checked against the RPC's bit for bit, and the metadata K3's SGLang
    processor reads (`get_mm_extra_meta`: one grid row and one original size per image)."""
    assert isinstance(aggregate, receiver.MultiModalEmbeddingData) and aggregate.ready
    rows = aggregate.get_embedding(is_concat=True)[Modality.IMAGE]
    assert rows.dtype == torch.bfloat16
    words = rows.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(words, np.concatenate([expected[i][0] for i in indices]))
    meta = aggregate.get_mm_extra_meta()
    assert meta["img_grid_thw"].dtype == torch.int64
    assert meta["img_grid_thw"].tolist() == [expected[i][1] for i in indices]
    assert meta["original_image_sizes"] == [expected[i][2] for i in indices]
    tokens = [h * w // (MERGE[0] * MERGE[1]) for _, h, w in meta["img_grid_thw"].tolist()]
    assert tokens == [len(expected[i][0]) for i in indices]
    return rows


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
