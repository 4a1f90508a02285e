"""The HTTP face's one error renderer: a failure, in the body shape of the route it answers
(OpenAI's error object, or SGLang's encoder's), with the status, the OpenAI `type` and whether the
connection closes all read from `service.errors.RULES`. So a failure gives the same status on every
route, and an answer the HTTP protocol itself gives (404, 405, 408, 431) is a kind like any other."""

from __future__ import annotations

import http
import json
from enum import StrEnum
from typing import Any

from fastapi.responses import JSONResponse

from service.errors import Failure, Kind
from service.openai.response import error_body

WWW_AUTHENTICATE = 'Bearer realm="kimi-vision"'


class Shape(StrEnum):
    OPENAI = "openai"
    SGLANG = "sglang"  # SGLang's encoder routes: {"status": "error", "message", "req_id"}


def body(failure: Failure, shape: Shape = Shape.OPENAI, req_id: Any = None) -> dict[str, Any]:
    if shape is Shape.SGLANG:
        return {"status": "error", "message": failure.message, "req_id": req_id}
    return error_body(failure)


def headers(failure: Failure) -> dict[str, str]:
    out = {"www-authenticate": WWW_AUTHENTICATE} if failure.kind == Kind.UNAUTHENTICATED else {}
    return out | ({"connection": "close"} if failure.rule.closes else {})


def error_response(failure: Failure, shape: Shape = Shape.OPENAI, req_id: Any = None,
                   extra_headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body(failure, shape, req_id), status_code=failure.rule.http,
                        headers=headers(failure) | (extra_headers or {}))


def raw_response(failure: Failure) -> bytes:
    """The whole HTTP/1.1 answer as bytes, for a connection refused before any request reached the
    app (the h11 guard): always closing."""
    content = json.dumps(error_body(failure)).encode()
    status = failure.rule.http
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(content)}\r\nconnection: close\r\n\r\n").encode() + content
