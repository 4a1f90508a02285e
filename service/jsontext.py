"""JSON text a caller sends (an HTTP body, a gRPC JSON field, a batch job's JSONL line), read by one
rule on every face: it may nest at most `MAX_JSON_DEPTH` levels (far deeper than any chat or tool
schema nests, far shallower than Python's recursion limit)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from service.errors import BadRequest

MAX_JSON_DEPTH = 64


def parse_json(raw: str | bytes, what: str) -> Any:
    """JSON text a caller sent, parsed: not JSON, or nested deeper than `MAX_JSON_DEPTH`, is bad
    input naming `what`."""
    try:
        return load_json(raw, what)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def load_json(raw: str | bytes, what: str) -> Any:
    """`json.loads` by the depth rule: nested deeper than `MAX_JSON_DEPTH` is bad input naming
    `what`; text that is not JSON raises json's own error (`ValueError`, `UnicodeDecodeError`), for a
    reader that names bad JSON its own way."""
    too_deep = BadRequest(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


def _depth(value: Any) -> int:
    """How deep `value` nests (a scalar: 0), without recursion (what a caller sends can be deep)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level + 1)
            if level + 1 <= MAX_JSON_DEPTH:  # no need to look deeper than the refusal
                stack.extend((child, level + 1) for child in children)
    return deepest
