"""What the batch tests share: the OpenAI Batch output schema (pydantic models written from OpenAI's
public API reference: the batch request output object; the chat completion object is
`openai_schema.ChatCompletion`), reading an
output file the way OpenAI's cookbook does, a real HTTP server on 127.0.0.1 for remote image URLs,
and the mixed input file every engine must answer alike."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from openai_schema import ChatCompletion
from PIL import Image
from pydantic import BaseModel, ConfigDict

from service.errors import RULES, Kind

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- the batch output line (OpenAI API reference: "The request output object") -------------------


class BatchError(_Strict):
    code: str  # a machine-readable error code
    message: str  # a human-readable error message


class BatchResponse(_Strict):
    status_code: int  # the HTTP status code of the response
    request_id: str
    body: dict[str, Any] | None  # the JSON body of the response (vLLM: null on a failed line)


class KimiVision(_Strict):
    """This project's extension object beside the OpenAI fields (not part of OpenAI's schema)."""

    line: int
    timings: dict[str, float]


class BatchRequestOutput(_Strict):
    id: str
    custom_id: str  # a developer-provided per-request id that matches outputs to inputs
    response: BatchResponse | None
    error: BatchError | None  # more information on the cause of a failure
    kimi_vision: KimiVision


# -- the body of an embedding line (this project's: the rows are in a safetensors shard) ---------


class EmbeddingRef(_Strict):
    file: str
    key: str
    shape: list[int]
    dtype: Literal["float32"]


class EmbeddingUsage(_Strict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingBody(_Strict):
    id: str
    object: Literal["embedding.safetensors"]
    created: int
    model: str
    embedding: EmbeddingRef
    grid_thw: list[int]
    usage: EmbeddingUsage


def validated_rows(path: Path) -> list[dict[str, Any]]:
    """Every line of a batch output file, each checked against the schema: a 200 has a body and no
    error; a failure has no body and the status its error kind's rule gives."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        out = BatchRequestOutput.model_validate(row)
        assert out.response is not None, f"line {number}: no response"
        if out.response.status_code == 200:
            assert out.error is None and out.response.body is not None, f"line {number}: {row}"
            body_model = EmbeddingBody if out.response.body.get("object") == "embedding.safetensors" else ChatCompletion
            body_model.model_validate(out.response.body)
        else:
            assert out.error is not None and out.response.body is None, f"line {number}: {row}"
            assert out.response.status_code == RULES[Kind(out.error.code)].http, f"line {number}: {row}"
        rows.append(row)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"ids written more than once: {sorted(i for i in ids if ids.count(i) > 1)}"
    return rows


def contents(path: Path) -> dict[str, str]:
    """The replies of the successful lines, read the way OpenAI's cookbook reads a batch output."""
    results = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["response"]["status_code"] == 200:
                results[row["custom_id"]] = json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
    return results


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A row without what differs run to run: ids, creation times, timings, the shard's file name."""
    out = json.loads(json.dumps(row))
    del out["id"], out["response"]["request_id"], out["kimi_vision"]["timings"]
    body = out["response"]["body"]
    if body is not None:
        del body["id"], body["created"]
        if "embedding" in body:
            del body["embedding"]["file"]
        for choice in body.get("choices", []):
            for call in choice["message"].get("tool_calls") or []:
                del call["id"]
    return out


@contextlib.contextmanager
def image_server(folder: Path) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving `folder`; yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _line(custom_id: str, content: list[dict[str, Any]] | str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


def _image(url: str, text: str = "What is it?") -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


# (custom_id, status, words its error message holds), in input order.
MIXED = [
    ("data-url", 200, None), ("by-path", 200, None), ("remote", 200, None),
    ("seeded-a", 200, None), ("seeded-b", 200, None), ("seeded-c", 200, None), ("greedy", 200, None),
    ("temperature-0", 200, None),
    ("bad-image", 400, "line 9: bad image: messages[0].content[0]: not a recognised image"),
    ("too-large", 413, "line 10: bad image: messages[0].content[0]: image is 131073x1; its longest side"),
    ("<line 11>", 400, "line 11: not valid JSON"),
    ("unsupported-parameter", 400, "line 12: unsupported parameter(s) ['best_of']"),
    ("other-model", 404, "line 13: model 'gpt-4o' is not served here"),
    ("remote-missing", 400, "/missing.png: HTTP 404"),
    ("embeddings-url", 400, "line 15: url /v1/embeddings: this job generates text"),
    ("data-url", 400, "line 17: custom_id 'data-url' is already the id of line 1"),  # its row's id: <line 17>
]


def write_mixed_input(folder: Path, remote: str) -> Path:
    """The mixed request file (`MIXED`): images as data: URLs, relative paths and remote URLs; a bad
    and a too-large image; a malformed line, an unsupported parameter, another model, a missing
    remote image, an embeddings line; a blank line; a repeated id. Sampling lines: two with seed 7,
    one with seed 8, greedy, and temperature 0 (which is greedy whatever the seed)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SAMPLES / "grayscale.png", folder / "gray.png")
    shutil.copy(SAMPLES / "photo.jpg", folder / "photo.jpg")
    (folder / "bad.png").write_text("this is text, not a PNG\n")
    Image.new("1", (131073, 1)).save(folder / "wide.png")  # a tiny file whose header is over the side limit
    data_url = "data:image/png;base64," + base64.b64encode((SAMPLES / "sticker_rgba.png").read_bytes()).decode()
    lines = [
        _line("data-url", _image(data_url), max_tokens=3),
        json.dumps({"custom_id": "by-path", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [
            {"role": "system", "content": "You describe images."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gray.png"}}]}],
            "max_tokens": 4}}),
        _line("remote", _image(f"{remote}/photo.jpg"), max_tokens=4),
        _line("seeded-a", _image("gray.png"), max_tokens=8, temperature=1.0, seed=7),
        _line("seeded-b", _image("gray.png"), max_tokens=8, temperature=1.0, seed=7),
        _line("seeded-c", _image("gray.png"), max_tokens=8, temperature=1.0, seed=8),
        _line("greedy", _image("gray.png"), max_tokens=8),
        _line("temperature-0", _image("gray.png"), max_tokens=8, temperature=0, seed=7),
        _line("bad-image", _image("bad.png")),
        _line("too-large", _image("wide.png")),
        '{"custom_id": "broken", "body": ',
        _line("unsupported-parameter", "Say hi.", best_of=2),
        _line("other-model", "Say hi.", model="gpt-4o"),
        _line("remote-missing", _image(f"{remote}/missing.png")),
        json.dumps({"custom_id": "embeddings-url", "method": "POST", "url": "/v1/embeddings",
                    "body": {"messages": [{"role": "user", "content": _image("gray.png")}]}}),
        "",
        _line("data-url", "A repeated id."),
    ]
    source = folder / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return source


def check_mixed_output(path: Path) -> list[dict[str, Any]]:
    """One row per line, in input order, with the right statuses and messages; sampling honoured."""
    rows = validated_rows(path)
    ids = [cid if words is None or not words.startswith("line 17") else "<line 17>" for cid, _, words in MIXED]
    assert [r["custom_id"] for r in rows] == ids
    assert [r["kimi_vision"]["line"] for r in rows] == [*range(1, 16), 17]
    for row, (custom_id, status, words) in zip(rows, MIXED, strict=True):
        assert row["response"]["status_code"] == status, (custom_id, row)
        if words is not None:
            assert words in row["error"]["message"], (custom_id, row["error"])
    texts = contents(path)
    assert texts["seeded-a"] == texts["seeded-b"] != texts["seeded-c"]  # the seed decides the draw
    assert texts["temperature-0"] == texts["greedy"]
    usage = {r["custom_id"]: r["response"]["body"]["usage"] for r in rows if r["response"]["status_code"] == 200}
    assert usage["data-url"]["completion_tokens"] == 3 and usage["greedy"]["completion_tokens"] <= 8
    # prompt_tokens counts each image's tokens after media_pad expansion: far more than the text
    assert all(u["prompt_tokens"] > 20 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
               for u in usage.values())
    return rows
