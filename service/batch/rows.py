"""One output line of a batch job, in the OpenAI Batch output shape as vLLM's `run_batch` writes it.

    {"id": "kimi-vision-<hex>", "custom_id": ...,
     "response": {"status_code": 200, "request_id": "kimi-vision-batch-<hex>", "body": {...}},
     "error": null,
     "kimi_vision": {"line": 7, "timings": {...}}}

- `body` is a `chat.completion` object (`service.openai.response.completion`) for generation, or
  for an embedding the safetensors reference (`embedding_body`): the rows themselves live in the
  job's shards.
- A failed line has `response.status_code` the HTTP status of its kind (`service.errors.RULES`),
  `response.body` null, and `error` `{"code": <kind>, "message": ...}` (the OpenAI reference's error
  object; `code` is the kind of the one taxonomy, so whether it is retried follows from it).
- `kimi_vision` is this project's extension, beside the OpenAI fields so the body stays
  OpenAI-shaped: `line` is the row's input position (its line in a JSONL or path list, its place in
  a directory's sorted listing), by which the finished file is put in input order; `timings` (ms).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from service.errors import RULES, Failure, Kind

EMBEDDING_OBJECT = "embedding.safetensors"  # the body's `object` for an embedding kept in a shard


def _row(custom_id: str, line: int, status_code: int, body: dict[str, Any] | None, error: dict[str, str] | None,
         timings: dict[str, float]) -> dict[str, Any]:
    return {
        "id": f"kimi-vision-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": f"kimi-vision-batch-{uuid.uuid4().hex}", "body": body},
        "error": error,
        "kimi_vision": {"line": line, "timings": timings},
    }


def ok_row(custom_id: str, line: int, body: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    return _row(custom_id, line, 200, body, None, timings)


def error_row(custom_id: str, line: int, failure: Failure, timings: dict[str, float]) -> dict[str, Any]:
    return _row(custom_id, line, failure.rule.http, None, {"code": failure.kind.value, "message": failure.message},
                timings)


def embedding_body(*, model: str, key: str, shape: list[int], dtype: str, grid_thw: list[int],
                   num_tokens: int) -> dict[str, Any]:
    """Where an image's embedding rows are: `embedding.file` is filled in when its shard is written."""
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": EMBEDDING_OBJECT,
        "created": int(time.time()),
        "model": model,
        "embedding": {"file": None, "key": key, "shape": shape, "dtype": dtype},
        "grid_thw": grid_thw,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def is_ok(row: dict[str, Any]) -> bool:
    return row["response"]["status_code"] == 200


def is_transient(row: dict[str, Any]) -> bool:
    """A failure of a kind the taxonomy retries (a `--resume` runs the line again)."""
    error = row.get("error")
    return error is not None and RULES[Kind(error["code"])].retry


def line_of(row: dict[str, Any]) -> int:
    return row["kimi_vision"]["line"]


def shard_file(row: dict[str, Any]) -> str | None:
    """The shard an embedding row points to (None for any other row)."""
    body = row["response"]["body"]
    if is_ok(row) and body.get("object") == EMBEDDING_OBJECT:
        return body["embedding"]["file"]
    return None


def error_message(row: dict[str, Any]) -> str:
    return row["error"]["message"]
