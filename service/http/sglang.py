"""SGLang 0.5.23's encoder disaggregation on the HTTP face: this server as the encoder
(`--encoder-only`) of SGLang language servers (`--language-only --encoder-urls http://...`), on the
same port as the OpenAI API, or on a listener of their own (`--epd-port`; the OpenAI port then
serves none). The routes, fields and answers are those of SGLang's own encoder server
(sglang/srt/disaggregation/encoder/http_server.py and runtime.py); what a route does is the
server's one `SglangEncoder` (`service.epd.sglang_encoder`, which the gRPC face's `grpc://`
service shares), so a route only reads its body and answers:

- `POST /encode` `{req_id, mm_items, modality, num_parts, part_idx, prefill_host, embedding_port, ...}`:
  one part of a request's items (`mm_items`: `data:` URLs, or `http(s)` ones with
  `--allow-remote-images`; a `{"url", "detail", "content_hash"}` item too: the one image-part rule
  of every face, `service.media.image_url`) is embedded by the engine and delivered by SGLang's ZMQ
  transport (`service.epd.sglang_zmq`) as SGLang's receiver reads it.
  It is admitted as the chat route is: its place first, the image count, then its images fetched
  by the face's one fetcher (the same rules: `--allowed-media-domains`, `--media-fetch-timeout`,
  `--max-media-fetches`; all at once, outside the work slots), and only then a work slot.
  Where to, the request says (`embedding_port`: an int, a list, or null for the ranks that register
  it); both backends are served at once, request by request. Every destination is checked by
  `--epd-allowed-destinations` (`service.epd.destinations`) before any connection: one not allowed
  is a 400 naming the rule, and gets no error report either. The answer, after the push: 200
  `null`. The request gives its admission place back once its rows are made: the push runs within
  the transport's own budget of sockets and time (503 when spent), so pushes to a slow language
  side never take capacity from the chat route; a client that leaves during the push is logged
  499 and the push goes on (a drain waits for it, up to its grace).
- `POST /scheduler_receive_url` `{req_id, receive_count, receive_url, modality}`: a scheduler rank
  names where it takes a part (`zmq_to_scheduler`); before or after that part's `/encode` arrives.
  The address is checked as an `/encode`'s; the part's other ranks register from the first one's
  host (another host's registration of it, or its count, is refused).
- `GET /health_generate`: a fresh tiny image through the engine when it is idle (200, else 503); `GET /health` is
  the face's own (200 serving, 503 warming up or draining), which SGLang's encoder registry probes.
- `POST /send`, `POST /scheduler_receive_meta_data`: SGLang's `mooncake` (RDMA) backend, not served:
  a clear error, which also ends a waiting `/encode` of that part at once.

A failure (a bad image, a full server, a bad field, a slow body) is answered at once in SGLang's
body shape by the face's one error renderer (`service.http.errors`: the status the taxonomy gives
on every route), and, once the part's destination is known, also pushed there as SGLang's error
`EmbeddingData`: the language side fails the request then, instead of waiting for its timeout.
These routes take no token: SGLang's language side sends none (serve them on `--epd-port`, facing
only the language servers).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from service.admission import Admission
from service.engine import MediaInput
from service.epd.sglang_encoder import SglangEncoder, echoed_req_id
from service.errors import Failure, failure_for
from service.http.errors import Shape, error_response
from service.http.gone import unless_disconnected

log = logging.getLogger("kimi_vision.sglang")

JsonReader = Callable[[Request], Awaitable[Any]]


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


def _error(failure: Failure, body: Any) -> Response:
    return error_response(failure, Shape.SGLANG, echoed_req_id(body))


def _probe_png() -> bytes:
    """32x32 random pixels (SGLang probes with a 32x32 PNG): never an embedding-cache hit."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def add_sglang_routes(app: FastAPI, admission: Admission, read_json: JsonReader, encoder: SglangEncoder) -> None:
    """Serve SGLang's encoder routes on `app`, each body read by `read_json` (admitted like the
    face's others) and done by the server's `encoder`."""

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            await encoder.encode(body, _peer(request), functools.partial(unless_disconnected, request))
        except Exception as exc:  # noqa: BLE001 - the taxonomy's status, SGLang's error body
            return _error(failure_for(exc), body)
        return JSONResponse(None)

    @app.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        body = None
        try:
            body = await read_json(request)
            await encoder.register(body, _peer(request))
        except Exception as exc:  # noqa: BLE001 - the taxonomy's status, SGLang's error body
            return _error(failure_for(exc), body)
        return JSONResponse(None)

    async def mooncake(request: Request) -> Response:
        """Refused; a waiting `/encode` of the part ends with the same error at once."""
        body = None
        with contextlib.suppress(Exception):  # the refusal does not depend on the body
            body = await read_json(request)
        return _error(encoder.refuse_mooncake(body, _peer(request)), body)

    app.post("/send")(mooncake)
    app.post("/scheduler_receive_meta_data")(mooncake)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's: a probe through the whole engine, unless requests are at work (then they are the
        proof, and the probe stays off the workers), as SGLang's encoder does."""
        if admission.serving and admission.working:
            return Response(status_code=200)
        try:
            async with admission.admit() as engine:
                await engine.embed([MediaInput(_probe_png())])
        except Exception as exc:  # noqa: BLE001 - any failure is unhealthy (the reason goes to the log)
            log.warning("health_generate: %s", failure_for(exc).message)
            return Response(status_code=503)
        return Response(status_code=200)
