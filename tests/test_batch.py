"""`kimi-vision batch`: real images (good and bad), a real server on 127.0.0.1, a real HTTP server for
remote images, real CLI processes; every output line checked against the OpenAI Batch output schema.

One server (the embedded default checkpoint: tiny random tower, trunk and tokenizer; one CPU
encoder worker) serves the module. The in-process engine tests reuse that server's loaded `Engine`,
so both modes run the same weights and their rows can be compared. A real `kimi-vision batch`
process is stopped with Ctrl-C, then SIGKILLed part-way through its resume; the next `--resume`
must leave every input in the output exactly once, in input order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from openai_batch import (
    MIXED,
    check_mixed_output,
    comparable,
    contents,
    image_server,
    validated_rows,
    write_mixed_input,
)
from safetensors.numpy import load_file

from service.batch.backends import EngineBackend, ServerBackend
from service.batch.inputs import InputError, base_dir, load_items
from service.batch.journal import ResumeRefused, fingerprint_path, finish, prepare, shard_dir
from service.batch.runner import Job, RunOptions
from service.batch.spec import JobSpec
from service.engine import EngineConfig
from service.engine.identity import checkpoint_fingerprint
from service.openai.request import parse_chat_request
from service.server import ServerConfig, ServerThread

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES = REPO_ROOT / "samples"
pytestmark = pytest.mark.timeout(300)

GOOD = ["photo.jpg", "grayscale.png", "sticker_rgba.png", "sub/deeper/palette.png"]
BAD = ["sub/not_an_image.jpg", "truncated.png"]
DIRECTORY_ORDER = ["grayscale.png", "photo.jpg", "sticker_rgba.png", "sub/deeper/palette.png",
                   "sub/not_an_image.jpg", "truncated.png"]




@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Good images in nested folders, two bad ones with image extensions, and a file to ignore."""
    root = tmp_path_factory.mktemp("images")
    (root / "sub" / "deeper").mkdir(parents=True)
    shutil.copy(SAMPLES / "photo.jpg", root / "photo.jpg")
    shutil.copy(SAMPLES / "grayscale.png", root / "grayscale.png")
    shutil.copy(SAMPLES / "sticker_rgba.png", root / "sticker_rgba.png")
    shutil.copy(SAMPLES / "palette_transparent.png", root / "sub" / "deeper" / "palette.png")
    (root / "sub" / "not_an_image.jpg").write_text("this is text, not a JPEG\n")
    (root / "truncated.png").write_bytes((SAMPLES / "grayscale.png").read_bytes()[:120])
    (root / "notes.txt").write_text("not an image extension: never an input\n")
    return root


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=str(tiny_checkpoint), devices="cpu:1",
                                                         cache_bytes=0)) as handle:
        yield handle


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The mixed request file, its remote images on a real HTTP server on 127.0.0.1."""
    folder = tmp_path_factory.mktemp("mixed")
    with image_server(folder) as remote:
        yield write_mixed_input(folder, remote)


def _options(concurrency: int) -> RunOptions:
    return RunOptions(concurrency=concurrency, tty=False, handle_sigint=False)


def _run(spec: JobSpec, source, output: Path, backend, *, resume: bool = False, concurrency: int = 2,
         errors: Path | None = None):
    async def go():
        job = Job(spec, load_items(source, spec), output, backend, resume=resume, base_dir=base_dir(source),
                  errors=errors, options=_options(concurrency))
        summary = await job.run()
        assert job.bug is None, summary.aborted
        return summary

    return asyncio.run(go())


def _server_run(target: str, spec: JobSpec, source, output: Path, *, resume: bool = False, concurrency: int = 4):
    async def go():
        backend = await ServerBackend.connect(target)
        try:
            job = Job(spec, load_items(source, spec), output, backend, resume=resume, base_dir=base_dir(source),
                      options=_options(concurrency))
            return await job.run()
        finally:
            await backend.close()

    return asyncio.run(go())


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "batch", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Inputs: every line an item, in input order


def test_every_input_line_is_an_item_in_input_order(images, tmp_path):
    caption = JobSpec("caption")
    items = list(load_items(images, caption))
    assert [i.custom_id for i in items] == DIRECTORY_ORDER  # recursive, sorted, `/`-separated, notes.txt skipped
    assert [i.line for i in items] == list(range(1, 7)) and not items[0].numbered
    # A directory's image becomes the request a JSONL line would carry: the image, then the task prompt.
    assert items[0].request == {"custom_id": "grayscale.png", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": [
                                    {"type": "image_url", "image_url": {"url": str(images / "grayscale.png")}},
                                    {"type": "text", "text": caption.effective_prompt}]}]}}
    assert parse_chat_request(items[0].request["body"]).media[0].url == str(images / "grayscale.png")
    embed = next(iter(load_items(images, JobSpec("embed")))).request
    assert embed["url"] == "/v1/embeddings" and len(embed["body"]["messages"][0]["content"]) == 1

    listing = tmp_path / "paths.txt"
    listing.write_text(f"# comment\n{images / 'photo.jpg'}\n\nrel/one.png\n")
    items = load_items(listing, caption)
    assert [(i.custom_id, i.line) for i in items] == [((images / "photo.jpg").as_posix(), 2), ("rel/one.png", 4)]

    source = tmp_path / "requests.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "line\u2028separator inside a string"}]}}
    source.write_bytes(b"\n".join([json.dumps(good, ensure_ascii=False).encode(), b"", b"{oops", b"[1, 2]",
                                   b'{"custom_id": 5}', b'{"custom_id": "a"}', b"\xff\xfe not UTF-8"]) + b"\n")
    items = list(load_items(source, caption))
    assert [(i.custom_id, i.line) for i in items] == [("a", 1), ("<line 3>", 3), ("<line 4>", 4), ("<line 5>", 5),
                                                      ("<line 6>", 6), ("<line 7>", 7)]
    assert items[0].request == good and items[0].problem is None
    assert [i.problem.split(" (")[0] for i in items[1:]] == [
        "not valid JSON: Expecting property name enclosed in double quotes",
        "a line must be a JSON object", "custom_id must be a non-empty string, got 5",
        "custom_id 'a' is already the id of line 1; ids must be unique", "not UTF-8 text"]

    for path, message in [(tmp_path / "nope", "no such file or directory"), (tmp_path / "empty.jsonl", "no inputs")]:
        if path.suffix:
            path.write_text("\n\n")
        with pytest.raises(InputError, match=message):
            load_items(path, caption)


def test_repeated_ids_are_found_however_far_apart(tmp_path):
    """Ids seen long before (merged into the id table's sorted part) and just before (still in its
    recent part) are both repeats; a generated `<line N>` id steps around ids taken."""
    lines = [{"custom_id": f"id{n}"} for n in range(1, 10001)]
    lines[4] = {"custom_id": "<line 10003>"}
    lines += [{"custom_id": "id1"}, {"custom_id": "id9999"}, {}, {"custom_id": "<line 10003>'"}]
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    inputs = load_items(source, JobSpec("caption"))
    items = list(inputs)
    assert len(inputs) == len(items) == 10004
    assert [i.custom_id for i in items[:4]] == ["id1", "id2", "id3", "id4"] and items[4].custom_id == "<line 10003>"
    assert all(i.problem is None for i in items[:10000])
    assert [(i.custom_id, i.line) for i in items[10000:]] == [
        ("<line 10001>", 10001), ("<line 10002>", 10002), ("<line 10003>'", 10003), ("<line 10004>", 10004)]
    assert [i.problem.split(";")[0] for i in items[10000:]] == [
        "custom_id 'id1' is already the id of line 1", "custom_id 'id9999' is already the id of line 9999",
        "custom_id must be a non-empty string, got None", "custom_id \"<line 10003>'\" is already the id of line 10003"]


def test_a_directory_is_walked_in_the_order_of_its_ids(tmp_path):
    for name in ["a0.png", "a/x.png", "a.png", "a-b.png", "a/b/y.png", "b/../c.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "c").symlink_to(tmp_path / "a")  # a symlinked directory is not followed
    (tmp_path / "d.png").symlink_to(tmp_path / "a.png")  # a symlinked file is read like a file
    items = list(load_items(tmp_path, JobSpec("embed")))
    assert [i.custom_id for i in items] == ["a-b.png", "a.png", "a/b/y.png", "a/x.png", "a0.png", "d.png"]
    assert [i.line for i in items] == list(range(1, 7))


def test_reading_an_input_holds_a_small_hash_per_line_not_its_items(tmp_path):
    import tracemalloc

    lines = 40_000
    # JSONL, not a path list: pathlib interns each path part, and the interpreter's table of
    # interned strings (all of pytest's too) is rebuilt now and then, a few MiB that the reading
    # does not hold.
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"img{n}", "method": "POST", "url": "/v1/embeddings",
                                          "body": {"messages": [{"role": "user", "content": [
                                              {"type": "image_url", "image_url": {"url": "img.png"}}]}]}}) + "\n"
                              for n in range(lines)))
    inputs = load_items(source, JobSpec("embed"))
    tracemalloc.start()
    try:
        read = sum(1 for _ in inputs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read == len(inputs) == lines
    # The id table's 24 bytes a line (32 while it merges) and a fixed part; the items themselves,
    # held, would be about 800 bytes a line.
    assert peak < (4 << 20) + 64 * lines, f"{peak / 2**20:.1f} MiB to read {lines} lines"


# ---------------------------------------------------------------------------------------------
# The journal: torn last line, transient failures, the errors file, input order, fingerprint


def _row(custom_id: str, line: int, status: int = 200, code: str | None = None, body: dict | None = None) -> dict:
    error = None if status == 200 else {"code": code, "message": f"{code} happened"}
    return {"id": f"r{line}", "custom_id": custom_id, "response": {"status_code": status, "request_id": "q",
                                                                   "body": body or {"object": "chat.completion"}
                                                                   if status == 200 else None},
            "error": error, "kimi_vision": {"line": line, "timings": {}}}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _done(prior, ids) -> list[str]:
    """Which of `ids` a resume does not run again; every id it read is one of them."""
    assert len(prior.ids) == len(list(ids))
    return [i for i in ids if prior.is_done(i)]


def test_journal_resume_input_order_and_the_errors_file(tmp_path):
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    fp = {"format": "x", "task": "caption"}
    prepare(output, fp, resume=False)
    rows = [_row("c", 3), _row("a", 1, 400, "bad_input"), _row("b", 2, 503, "unavailable")]
    output.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"custom_id": "d", "sta')
    prior = prepare(output, fp, resume=True)
    # 503: its kind is retried
    assert _done(prior, ["a", "b", "c"]) == ["a", "c"] and prior.torn and prior.retrying == 1
    assert [r["custom_id"] for r in _lines(output)] == ["c", "a"] and output.read_bytes().endswith(b"\n")

    # Every line has its row: finish puts them in input order; with an errors file, failures move there.
    with output.open("a") as f:
        f.write(json.dumps(_row("b", 2)) + "\n")
    finish(output)
    assert [r["custom_id"] for r in _lines(output)] == ["a", "b", "c"]
    finish(output, errors)
    assert [r["custom_id"] for r in _lines(output)] == ["b", "c"] and [r["custom_id"] for r in _lines(errors)] == ["a"]

    # A resume takes the failed rows back (and a crash between finish's two renames, which leaves
    # them in both files, counts them once).
    with pytest.raises(ResumeRefused, match="already holds results; pass --resume"):
        prepare(output, fp, resume=False, errors=errors)
    with output.open("a") as f:
        f.write(json.dumps(_row("a", 1, 400, "bad_input")) + "\n")
    prior = prepare(output, fp, resume=True, errors=errors)
    assert (prior.ok, prior.errors, prior.dropped) == (2, 1, 1) and not errors.exists()
    assert sorted(r["custom_id"] for r in _lines(output)) == ["a", "b", "c"]
    with pytest.raises(ResumeRefused, match=r"options differ .*task: was \"caption\", now \"ocr\""):
        prepare(output, {"format": "x", "task": "ocr"}, resume=True)

    # A row whose embedding shard is gone runs again; a shard no row points to is deleted.
    shards = shard_dir(output)
    shards.mkdir()
    (shards / "shard-00001.safetensors").write_bytes(b"kept")
    (shards / "shard-00002.safetensors").write_bytes(b"orphan: written just before a crash, rows never were")
    (shards / ".shard-00003.safetensors.tmp").write_bytes(b"cut short")
    (tmp_path / f".{output.name}.999-0123456789ab.tmp").write_bytes(b"a rewrite cut short by a crash")
    (tmp_path / f".{output.name}.999.run-0.tmp").write_bytes(b"a reorder cut short by a crash")

    def embedding(custom_id: str, line: int, file: str) -> dict:
        body = {"object": "embedding.safetensors", "embedding": {"file": f"{output.name}.embeddings/{file}"}}
        return _row(custom_id, line, body=body)

    with output.open("a") as f:
        f.write(json.dumps(embedding("e1", 4, "shard-00001.safetensors")) + "\n")
        f.write(json.dumps(embedding("e2", 5, "gone.safetensors")) + "\n")
    prior = prepare(output, fp, resume=True)
    assert _done(prior, ["a", "b", "c", "e1", "e2"]) == ["a", "b", "c", "e1"] and prior.retrying == 1
    assert sorted(p.name for p in shards.iterdir()) == ["shard-00001.safetensors"]
    assert not list(tmp_path.glob(".*.tmp"))

    # Anything but a last line that is not a row means someone else edited the file: refuse.
    output.write_text(json.dumps(_row("a", 1)) + "\nnot json\n" + json.dumps(_row("b", 2)) + "\n")
    with pytest.raises(ResumeRefused, match="line 2 of .* is not a result row"):
        prepare(output, fp, resume=True)

    fingerprint_path(output).unlink()
    with pytest.raises(ResumeRefused, match="job file .* is missing"):
        prepare(output, fp, resume=True)


def test_resume_reads_many_rows_into_the_id_table(tmp_path):
    """More rows than the id table holds before its first merge: each one's verdict is kept."""
    output = tmp_path / "out.jsonl"
    fp = {"format": "x", "task": "caption"}
    prepare(output, fp, resume=False)
    def row(n: int) -> dict:
        if n % 7 == 0:
            return _row(f"id{n}", n, 503, "unavailable")
        return _row(f"id{n}", n, 400, "bad_input") if n % 5 == 0 else _row(f"id{n}", n)

    rows = [row(n) for n in range(1, 10001)]
    output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prior = prepare(output, fp, resume=True)
    transient = {n for n in range(1, 10001) if n % 7 == 0}
    assert [n for n in range(1, 10001) if not prior.is_done(f"id{n}")] == sorted(transient)
    assert not prior.is_done("id0") and not prior.is_done("id10001")
    assert (prior.kept, prior.retrying, len(prior.ids)) == (10000 - len(transient), len(transient), 10000)
    assert prior.errors == sum(1 for n in range(1, 10001) if n % 5 == 0 and n % 7)
    assert len(_lines(output)) == prior.kept


def test_finish_merges_many_sorted_runs(tmp_path, monkeypatch):
    """With runs of 7 rows merged 3 at a time, 500 rows take three levels of merges; the rows come
    out in input order, the failed ones split out, nothing left beside the output."""
    from service.batch import journal

    monkeypatch.setattr(journal, "_RUN_ROWS", 7)
    monkeypatch.setattr(journal, "_FAN_IN", 3)
    order = np.random.default_rng(0).permutation(np.arange(1, 501)).tolist()
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    output.write_text("".join(json.dumps(_row(f"id{n}", n, 400 if n % 9 == 0 else 200, "bad_input")) + "\n"
                              for n in order))
    finish(output)
    assert [r["kimi_vision"]["line"] for r in _lines(output)] == list(range(1, 501))
    in_order = output.stat()
    runs: list[int] = []
    write_run = journal._write_run

    def counted_write_run(output, number, records):
        runs.append(number)
        return write_run(output, number, records)

    monkeypatch.setattr(journal, "_write_run", counted_write_run)
    finish(output)  # in order already, no errors file: not rewritten, and no run written to find that out
    assert output.stat().st_ino == in_order.st_ino and output.stat().st_mtime_ns == in_order.st_mtime_ns
    assert runs == []

    output.write_text("".join(json.dumps(_row(f"id{n}", n, 400 if n % 9 == 0 else 200, "bad_input")) + "\n"
                              for n in order))
    finish(output, errors)
    assert len(runs) > 500 // 7  # out of order: sorted in runs
    assert [r["custom_id"] for r in _lines(output)] == [f"id{n}" for n in range(1, 501) if n % 9]
    assert [r["custom_id"] for r in _lines(errors)] == [f"id{n}" for n in range(9, 501, 9)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.jsonl", "out.jsonl"]


def test_finish_replaces_the_errors_file_before_the_output(tmp_path, monkeypatch):
    """A crash between the two renames must leave the failed rows in both files (a resume counts
    them once), never in neither: the errors file goes into place first. The real rename still runs."""
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    output.write_text("".join(json.dumps(r) + "\n" for r in [_row("b", 2), _row("a", 1, 400, "bad_input")]))
    replaced: list[str] = []
    real_replace = os.replace

    def replace(src, dst) -> None:
        real_replace(src, dst)
        replaced.append(Path(dst).name)

    monkeypatch.setattr(os, "replace", replace)
    finish(output, errors)
    assert replaced == ["errors.jsonl", "out.jsonl"]
    assert [r["custom_id"] for r in _lines(output)] == ["b"] and [r["custom_id"] for r in _lines(errors)] == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.jsonl", "out.jsonl"]


# ---------------------------------------------------------------------------------------------
# The mixed request file, in-process and through a real server


def test_mixed_requests_in_process_and_through_a_server(server, mixed, tmp_path):
    """Data URLs, paths, a remote URL, a bad and a too-large image, a malformed line, an unsupported
    parameter, another model, sampling: one row per line, in input order, the same on both engines."""
    # The remote images come from this test's own server on 127.0.0.1, allowed as tests allow it.
    spec = JobSpec("caption", allow_remote_images=True, allowed_media_domains=("127.0.0.1",))
    local_out, local_errors = tmp_path / "local.jsonl", tmp_path / "local-errors.jsonl"
    summary = _run(spec, mixed, local_out, EngineBackend(server.engine), concurrency=4, errors=local_errors)
    ok = sum(status == 200 for _, status, _ in MIXED)
    assert (summary.ok, summary.errors, summary.transient, summary.exit_code) == (ok, len(MIXED) - ok, 0, 0)
    # --errors splits the failed lines out, each file in input order.
    rows = validated_rows(local_out) + validated_rows(local_errors)
    assert all(r["response"]["status_code"] == 200 for r in validated_rows(local_out))
    merged = tmp_path / "merged.jsonl"
    merged.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["kimi_vision"]["line"])))
    local = check_mixed_output(merged)
    assert [r["kimi_vision"]["line"] for r in validated_rows(local_errors)] == sorted(
        r["kimi_vision"]["line"] for r in validated_rows(local_errors))

    server_out = tmp_path / "server.jsonl"
    summary = _server_run(server.target, spec, mixed, server_out)
    assert summary.exit_code == 0
    via_server = check_mixed_output(server_out)
    assert [comparable(r) for r in via_server] == [comparable(r) for r in local]  # byte-identical bar ids, times

    # prompt_tokens is the prompt after media_pad expansion, as the engine counts it.
    greedy = next(item for item in load_items(mixed, spec) if item.custom_id == "greedy")
    request = parse_chat_request(greedy.request["body"])
    media = [request.media[0].input((mixed.parent / "gray.png").read_bytes())]
    chat = dataclasses.replace(request.chat, kwargs={"thinking": False})
    engine = server.engine
    prepared = asyncio.run(engine.prepare(engine.check(media, chat), media, chat))
    usage = next(r for r in local if r["custom_id"] == "greedy")["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len(prepared.prompt.ids) > prepared.media_tokens[0] > 0

    # --ignore-model runs the line that names another model; without --allow-remote-images a remote
    # image is that line's error.
    strict = _run(JobSpec("caption"), mixed, tmp_path / "strict.jsonl", EngineBackend(server.engine), concurrency=4)
    assert strict.ok == ok - 1
    remote = next(r for r in validated_rows(tmp_path / "strict.jsonl") if r["custom_id"] == "remote")
    assert "remote image URLs are not fetched unless the server or job runs with --allow-remote-images" in \
        remote["error"]["message"]
    # Without the allow list the batch job's fetches follow the server's rules: loopback is refused.
    guarded = _run(JobSpec("caption", allow_remote_images=True), mixed, tmp_path / "guarded.jsonl",
                   EngineBackend(server.engine), concurrency=4)
    assert guarded.ok == ok - 1
    refused = next(r for r in validated_rows(tmp_path / "guarded.jsonl") if r["custom_id"] == "remote")
    assert refused["response"]["status_code"] == 400 and "is not a public address" in refused["error"]["message"]
    one = tmp_path / "one.jsonl"
    one.write_text(mixed.read_text().splitlines()[12] + "\n")
    _run(JobSpec("caption", ignore_model=True), one, tmp_path / "ignored.jsonl", EngineBackend(server.engine))
    assert list(contents(tmp_path / "ignored.jsonl")) == ["other-model"]


def test_caption_folder_with_bad_images_server_and_local_agree(server, images, tmp_path):
    spec = JobSpec("caption", max_new_tokens=6)
    via_server = tmp_path / "server.jsonl"
    summary = _server_run(server.target, spec, images, via_server)
    assert (summary.ok, summary.errors, summary.transient, summary.exit_code) == (len(GOOD), len(BAD), 0, 0)
    rows = validated_rows(via_server)
    assert [r["custom_id"] for r in rows] == DIRECTORY_ORDER
    for row in rows:
        if row["custom_id"] in GOOD:
            body = row["response"]["body"]
            assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
            assert body["model"] == server.engine.model_id and body["choices"][0]["message"]["reasoning"] is None
        else:  # a directory's lines are named by their custom_id, not a line number
            assert row["error"]["code"] == "bad_input" and row["error"]["message"].startswith("bad image: ")

    in_process = tmp_path / "local.jsonl"
    _run(spec, images, in_process, EngineBackend(server.engine))
    assert [comparable(r) for r in validated_rows(in_process)] == [comparable(r) for r in rows]
    # Local and server name the same model, so either may resume the other's output.
    assert json.loads(fingerprint_path(in_process).read_text()) == json.loads(fingerprint_path(via_server).read_text())


def test_embedding_lines(server, tmp_path):
    """/v1/embeddings lines (vLLM's multimodal form) into shards; text input and chat lines refused."""
    shutil.copy(SAMPLES / "grayscale.png", tmp_path / "gray.png")
    image = [{"type": "image_url", "image_url": {"url": "gray.png"}}]
    lines = [{"custom_id": "img", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": server.engine.model_id, "messages": [{"role": "user", "content": image}],
                       "encoding_format": "float"}},
             {"custom_id": "text", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello"}},
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": image}]}},
             {"custom_id": "two", "url": "/v1/embeddings",
              "body": {"messages": [{"role": "user", "content": [*image, {"type": "text", "text": "and"}]}]}}]
    source = tmp_path / "embed.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    summary = _run(JobSpec("embed"), source, output, EngineBackend(server.engine))
    assert (summary.ok, summary.errors) == (1, 3)
    img, text, chat, two = validated_rows(output)
    ref = img["response"]["body"]["embedding"]
    tensor = load_file(str(output.parent / ref["file"]))[ref["key"]]
    assert ref["key"] == "img" and list(tensor.shape) == ref["shape"] == [
        img["response"]["body"]["usage"]["prompt_tokens"], server.engine.hidden_size]
    assert "text embeddings are not served" in text["error"]["message"]
    assert "this is an embedding job (--task embed)" in chat["error"]["message"]
    assert "exactly one image_url part and nothing else" in two["error"]["message"]


def test_a_bad_sampling_value_is_the_same_error_row_in_process_and_through_a_server(server, tmp_path):
    """Sampling ranges are SamplingParams' alone: each bad value is a bad_input row with its message,
    on either engine; a value in range is answered."""
    cases = [({"top_p": 5}, "top_p must be in (0, 1], got 5.0"),
             ({"temperature": -1}, "temperature must be >= 0, got -1.0"),
             ({"top_k": -1}, "top_k must be >= 0, got -1"),
             ({"temperature": 0.5, "top_p": 1, "top_k": 0, "seed": 3}, None)]
    source = tmp_path / "sampling.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"c{i}", "body": {
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **sampling}}) + "\n"
        for i, (sampling, _) in enumerate(cases)))
    local, remote = tmp_path / "local.jsonl", tmp_path / "server.jsonl"
    _run(JobSpec("caption"), source, local, EngineBackend(server.engine))
    _server_run(server.target, JobSpec("caption"), source, remote)
    for output in (local, remote):
        rows = validated_rows(output)
        for line, (row, (_, message)) in enumerate(zip(rows, cases, strict=True), 1):
            if message is None:
                assert row["response"]["status_code"] == 200, row
            else:
                assert (row["error"]["code"], row["error"]["message"]) == ("bad_input", f"line {line}: {message}")
    assert [comparable(r)["error"] for r in validated_rows(local)] == [
        comparable(r)["error"] for r in validated_rows(remote)]


def test_transient_failures_are_recorded_then_retried_by_resume(server, images, tmp_path):
    """A server that goes away mid-job: its lines become transient rows (503, exit 75), too many in a
    row stop the job (exit 1), and --resume on a healthy server redoes exactly those."""
    spec = JobSpec("embed")
    output = tmp_path / "out.jsonl"

    async def against_a_vanishing_server(max_consecutive: int | None):
        doomed = ServerThread(ServerConfig(port=0), engine=server.engine).wait_ready()
        backend = await ServerBackend.connect(doomed.target)
        doomed.drain(0)
        doomed.stop()
        try:
            options = RunOptions(concurrency=1, retries=1, backoff_s=0.01, max_consecutive_transient=max_consecutive,
                                 tty=False, handle_sigint=False)
            return await Job(spec, load_items(images, spec), output, backend, resume=True, base_dir=images,
                             options=options).run()
        finally:
            await backend.close()

    summary = asyncio.run(against_a_vanishing_server(None))
    assert (summary.ok, summary.transient, summary.exit_code) == (0, len(GOOD + BAD), 75)
    assert all(r["response"]["status_code"] == 503 and r["error"]["code"] == "unavailable"
               and r["error"]["message"].startswith("server UNAVAILABLE") for r in validated_rows(output))
    assert "rerun with --resume to retry the transient failures" in summary.line(output)

    output.unlink()
    stopped = asyncio.run(against_a_vanishing_server(2))
    assert stopped.exit_code == 1 and stopped.transient == 2 and "2 transient failures in a row" in stopped.aborted

    summary = _server_run(server.target, spec, images, output, resume=True)
    assert summary.prior.retrying == 2 and summary.skipped == 0
    assert (summary.ok, summary.errors, summary.transient, summary.exit_code) == (len(GOOD), len(BAD), 0, 0)
    assert [r["custom_id"] for r in validated_rows(output)] == DIRECTORY_ORDER


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "batch", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_rows(proc: subprocess.Popen, output: Path, rows: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if output.exists() and output.read_bytes().count(b"\n") >= rows:
            return
        time.sleep(0.02)


def test_ctrl_c_then_kill_9_then_resume_gives_every_input_exactly_once_in_input_order(server, tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(15):
        shutil.copy(SAMPLES / ("sticker_rgba.png" if i % 2 else "grayscale.png"), folder / f"img{i:02d}.png")
    # Right after img07.png: with two lines in flight its error row is written before img07's row.
    (folder / "img07b.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    names = sorted(p.name for p in folder.iterdir())
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ["--task", "caption", "--input", str(folder), "--output", str(output), "--errors", str(errors),
            "--server", server.target, "--concurrency", "2", "--max-new-tokens", "8"]

    # Ctrl-C: stops cleanly (whole rows only, exit 130, says how to finish).
    proc = _start(args)
    _wait_for_rows(proc, output, 2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted (rows in completion order until it finishes): rerun with --resume" in stdout
    after_ctrl_c = output.read_bytes()
    assert after_ctrl_c.endswith(b"\n") and 2 <= after_ctrl_c.count(b"\n") < 16 and not errors.exists()

    # kill -9 part-way through the resumed job.
    proc = _start([*args, "--resume"])
    _wait_for_rows(proc, output, after_ctrl_c.count(b"\n") + 2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    written = output.read_bytes().count(b"\n")
    assert after_ctrl_c.count(b"\n") + 2 <= written < 16, f"the kill should land part-way ({written} of 16 rows)"

    again = _cli(*args)  # the same options without --resume: refused, nothing touched
    assert again.returncode == 1 and "pass --resume" in again.stderr
    changed = _cli(*args[:-1], "9", "--resume")
    assert changed.returncode == 1
    assert "--resume refused" in changed.stderr and "max_new_tokens: was 8, now 9" in changed.stderr

    resumed = _cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{written} already done" in resumed.stdout and "gibberish" in resumed.stdout
    ok, failed = validated_rows(output), validated_rows(errors)  # each asserts no id twice
    assert [r["custom_id"] for r in ok] == [n for n in names if n != "img07b.png"]  # in input order
    assert [r["custom_id"] for r in failed] == ["img07b.png"] and failed[0]["response"]["status_code"] == 400
    assert sorted(contents(output)) == sorted(n for n in names if n != "img07b.png")

    # Resuming the finished job runs nothing, takes the failed line back and splits it out again.
    done = _cli(*args, "--resume")
    assert done.returncode == 0 and "16 already done; 0 processed" in done.stdout, done.stderr
    assert [comparable(r) for r in validated_rows(output)] == [comparable(r) for r in ok]
    assert [comparable(r) for r in validated_rows(errors)] == [comparable(r) for r in failed]


@pytest.mark.parametrize(("flag", "value", "problem"), [
    ("--concurrency", "0", "must be >= 1, got 0"),
    ("--max-new-tokens", "-1", "must be >= 1, got -1"),
    ("--log-every", "0", "must be a finite number > 0, got '0'"),
])
def test_a_flag_out_of_its_range_is_a_usage_error(flag, value, problem, capsys):
    from service.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["batch", "--task", "caption", "--input", "in", "--output", "out.jsonl", flag, value])
    assert exit_info.value.code == 2
    assert f"kimi-vision batch: error: argument {flag}: {problem}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["batch", "serve"])
def test_the_flags_default_to_the_configs_defaults(command):
    """Each default is written once, in its config: the flags (and their help) read it from there."""
    from service.cli.main import build_parser
    from service.engine import EngineConfig
    from service.fetch import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT_S
    from service.server import ServerConfig

    argv = [command] + (["--task", "caption", "--input", "in", "--output", "out.jsonl"] if command == "batch" else [])
    args = build_parser(argv).parse_args(argv)
    assert (args.media_fetch_timeout, args.max_media_fetches) == (DEFAULT_TIMEOUT_S, DEFAULT_CONCURRENCY)
    if command == "serve":
        engine, server = EngineConfig("unused"), ServerConfig()
        assert (args.max_images, args.max_num_seqs, args.max_num_batched_tokens, args.cache_mb << 20,
                args.mm_hasher_algorithm) == (engine.max_images, engine.max_num_seqs, engine.max_num_batched_tokens,
                                              engine.cache_bytes, engine.hash_algorithm)
        assert (args.max_concurrency, args.max_queue, args.max_bodies_in_flight, args.port) == (
            server.max_concurrency, server.max_queue, server.max_bodies_in_flight, server.port)


def test_progress_bar_on_a_tty_and_log_lines_otherwise():
    import io

    from service.batch.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar_stream = Terminal()
    bar = Progress(3, stream=bar_stream)
    for ok in (True, False, True):
        bar.update(ok)
    bar.close()
    assert "3/3" in bar_stream.getvalue() and "errors=1" in bar_stream.getvalue() and "img/s" in bar_stream.getvalue()

    log_stream = io.StringIO()
    log = Progress(4, stream=log_stream, log_every_s=0.0)
    log.update(True)
    log.update(False)
    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("batch: 2/4 done,") and lines[-1].endswith("ETA 0:00, 1 errors")


# ---------------------------------------------------------------------------------------------
# The CLI in-process (the default mode): embeddings into shards


def test_embed_cli_in_process_writes_shards_equal_to_the_server(server, tiny_checkpoint, images, tmp_path):
    output = tmp_path / "emb.jsonl"
    done = _cli("--task", "embed", "--input", str(images), "--output", str(output), "--devices", "cpu:1")
    assert done.returncode == 0, done.stderr
    assert f"{len(GOOD)} ok, {len(BAD)} errors" in done.stdout
    rows = validated_rows(output)
    assert [r["custom_id"] for r in rows] == DIRECTORY_ORDER
    fp = json.loads(fingerprint_path(output).read_text())
    assert fp["task"] == "embed" and fp["model"] == checkpoint_fingerprint(tiny_checkpoint)

    via_server = tmp_path / "server.jsonl"
    _server_run(server.target, JobSpec("embed"), images, via_server)
    reference = validated_rows(via_server)
    assert [comparable(r) for r in rows] == [comparable(r) for r in reference]
    for row, ref in zip(rows, reference, strict=True):
        if row["custom_id"] in GOOD:
            emb, ref_emb = row["response"]["body"]["embedding"], ref["response"]["body"]["embedding"]
            tensor = load_file(str(output.parent / emb["file"]))[emb["key"]]
            assert list(tensor.shape) == emb["shape"] == [row["response"]["body"]["usage"]["prompt_tokens"], 64]
            expected = load_file(str(via_server.parent / ref_emb["file"]))[ref_emb["key"]]
            np.testing.assert_array_equal(tensor, expected)  # one path: the same rows, bit for bit
        else:  # decoded in an encoder worker here, in the server's process there: the same row
            assert row["error"]["message"].startswith("bad image: ")
    assert [p.name for p in shard_dir(output).iterdir()] == ["shard-00001.safetensors"]

    usage = _cli("--task", "embed", "--input", str(images), "--output", str(output), "--prompt", "x")
    assert usage.returncode == 2 and "do not apply to --task embed" in usage.stderr
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("{}\n")
    usage = _cli("--task", "caption", "--input", str(jsonl), "--output", str(output), "--prompt", "x")
    assert usage.returncode == 2 and "a JSONL line's prompt is its own messages" in usage.stderr
