"""`kimi-vision batch`: real images (good and bad), a real server on 127.0.0.1, real CLI processes.

One server (the embedded default checkpoint: tiny random tower, trunk and tokenizer; one CPU
encoder worker) serves the module. The in-process engine tests reuse that server's loaded `Engine`, so both modes run
the same weights and their rows can be compared. A real `kimi-vision batch` process is stopped with
Ctrl-C, then SIGKILLed part-way through its resume; the next `--resume` must leave every input in
the output exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import collections
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
from safetensors.numpy import load_file

from service.batch.backends import EngineBackend, ServerBackend
from service.batch.inputs import InputError, load_items
from service.batch.journal import ResumeRefused, fingerprint_path, prepare, shard_dir
from service.batch.runner import Job, JobSpec, RunOptions
from service.checkpoints.default import default_checkpoint_dir
from service.engine import EngineConfig
from service.engine.identity import checkpoint_fingerprint
from service.rpc.server import ServerConfig, ServerThread

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES = REPO_ROOT / "samples"
pytestmark = pytest.mark.timeout(300)

GOOD = ["photo.jpg", "grayscale.png", "sticker_rgba.png", "sub/deeper/palette.png"]
BAD = ["sub/not_an_image.jpg", "truncated.png"]


@pytest.fixture(scope="module")
def checkpoint():
    """The embedded default (tiny random tower, MXFP4 trunk, tiny tokenizer): what `batch` uses
    when given no --checkpoint."""
    return default_checkpoint_dir()


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
def server(checkpoint):
    with ServerThread(ServerConfig(port=0), EngineConfig(checkpoint=str(checkpoint), devices="cpu:1",
                                                         cache_bytes=0)) as handle:
        yield handle


def _rows(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def _by_id(output: Path) -> dict[str, dict]:
    rows = _rows(output)
    counts = collections.Counter(r["custom_id"] for r in rows)
    assert max(counts.values()) == 1, f"ids written more than once: {[k for k, n in counts.items() if n > 1]}"
    return {r["custom_id"]: r for r in rows}


def _without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "timings"}


def _run(spec: JobSpec, source, output: Path, backend, *, resume: bool = False, concurrency: int = 2):
    async def go():
        job = Job(spec, load_items(source), output, backend, resume=resume,
                  options=RunOptions(concurrency=concurrency, tty=False, handle_sigint=False))
        summary = await job.run()
        assert job.bug is None, summary.aborted
        return summary

    return asyncio.run(go())


def _server_run(target: str, spec: JobSpec, source, output: Path, **kwargs):
    async def go():
        backend = await ServerBackend.connect(target)
        try:
            job = Job(spec, load_items(source), output, backend, resume=kwargs.get("resume", False),
                      options=RunOptions(concurrency=kwargs.get("concurrency", 4), tty=False, handle_sigint=False))
            return await job.run()
        finally:
            await backend.close()

    return asyncio.run(go())


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "batch", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Inputs


def test_inputs_directory_jsonl_and_list(images, tmp_path):
    ids = [item.custom_id for item in load_items(images)]
    assert sorted(ids) == sorted(GOOD + BAD)  # recursive, by extension, `/`-separated, notes.txt skipped

    listing = tmp_path / "paths.txt"
    listing.write_text(f"# comment\n{images / 'photo.jpg'}\n\nrel/one.png\n")
    items = load_items(listing)
    assert [i.custom_id for i in items] == [(images / "photo.jpg").as_posix(), "rel/one.png"]
    assert items[1].images[0].path == str(tmp_path / "rel" / "one.png")

    bad = tmp_path / "bad.jsonl"
    for text, message in [
        ('{"custom_id": "a", "body": {"messages": []}}', "bad.jsonl:1: body.messages must be a non-empty list"),
        ('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n{"oops"',
         "bad.jsonl:2: not valid JSON"),
        ('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}\n' * 2,
         "custom_id 'a' appears more than once"),
        ('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": [{"type": "image_url", '
         '"image_url": {"url": "https://example.com/x.png"}}]}]}}', "remote image URLs are not fetched"),
    ]:
        bad.write_text(text)
        with pytest.raises(InputError, match=message.replace("(", r"\(")):
            load_items(bad)
    with pytest.raises(InputError, match="no such file or directory"):
        load_items(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# The journal: torn last line, transient failures, fingerprint


def test_resume_drops_a_torn_last_line_and_transient_failures(tmp_path):
    output = tmp_path / "out.jsonl"
    fp = {"format": "x", "task": "caption"}
    prepare(output, fp, resume=False)
    rows = [{"custom_id": "a", "status": "ok", "text": "A"},
            {"custom_id": "b", "status": "error", "error": "bad image", "transient": False},
            {"custom_id": "c", "status": "error", "error": "server: UNAVAILABLE", "transient": True}]
    output.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"custom_id": "d", "sta')
    prior = prepare(output, fp, resume=True)
    assert prior.done == {"a", "b"} and prior.torn and prior.retrying == 1
    assert [r["custom_id"] for r in _rows(output)] == ["a", "b"]  # rewritten whole, ends with a newline
    assert output.read_bytes().endswith(b"\n")

    with pytest.raises(ResumeRefused, match="already holds results; pass --resume"):
        prepare(output, fp, resume=False)
    with pytest.raises(ResumeRefused, match=r"options differ .*task: was \"caption\", now \"ocr\""):
        prepare(output, {"format": "x", "task": "ocr"}, resume=True)

    # A row whose embedding shard is gone runs again; a shard no row points to is deleted.
    shards = shard_dir(output)
    shards.mkdir()
    (shards / "shard-00001.safetensors").write_bytes(b"kept")
    (shards / "shard-00002.safetensors").write_bytes(b"orphan: written just before a crash, rows never were")
    (shards / ".shard-00003.safetensors.tmp").write_bytes(b"cut short")
    embedded = [{"custom_id": "e1", "status": "ok", "embedding": {"file": f"{output.name}.embeddings/shard-00001"
                                                                         ".safetensors", "key": "e1"}},
                {"custom_id": "e2", "status": "ok", "embedding": {"file": f"{output.name}.embeddings/gone"
                                                                         ".safetensors", "key": "e2"}}]
    with output.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in embedded))
    prior = prepare(output, fp, resume=True)
    assert prior.done == {"a", "b", "e1"} and prior.retrying == 1
    assert sorted(p.name for p in shards.iterdir()) == ["shard-00001.safetensors"]

    # Anything but a last line that is not a row means someone else edited the file: refuse.
    output.write_text('{"custom_id": "a", "status": "ok"}\nnot json\n{"custom_id": "b", "status": "ok"}\n')
    with pytest.raises(ResumeRefused, match="line 2 of .* is not a result row"):
        prepare(output, fp, resume=True)

    fingerprint_path(output).unlink()
    with pytest.raises(ResumeRefused, match="job file .* is missing"):
        prepare(output, fp, resume=True)


# ---------------------------------------------------------------------------------------------
# Through a real server, and in-process on the same engine


def test_caption_folder_with_bad_images_server_and_local_agree(server, images, tmp_path):
    spec = JobSpec("caption", max_new_tokens=6)
    via_server = tmp_path / "server.jsonl"
    summary = _server_run(server.target, spec, images, via_server)
    assert (summary.ok, summary.errors, summary.transient, summary.exit_code) == (len(GOOD), len(BAD), 0, 0)
    rows = _by_id(via_server)
    assert sorted(rows) == sorted(GOOD + BAD)
    for name in GOOD:
        row = rows[name]
        assert row["status"] == "ok" and row["error"] is None and isinstance(row["text"], str)
        assert row["tokens"]["completion"] == 6 and row["finish_reason"] == "length"
        assert row["tokens"]["image"] > 0 and row["tokens"]["prompt"] > row["tokens"]["image"]
    assert "bad image" in rows["sub/not_an_image.jpg"]["error"] and rows["truncated.png"]["status"] == "error"
    assert rows["truncated.png"]["transient"] is False

    in_process = tmp_path / "local.jsonl"
    _run(spec, images, in_process, EngineBackend(server.engine))
    local = _by_id(in_process)
    assert {k: _without_timings(v) for k, v in local.items()} == {k: _without_timings(v) for k, v in rows.items()}
    # Local and server name the same model, so either may resume the other's output.
    assert json.loads(fingerprint_path(in_process).read_text()) == json.loads(fingerprint_path(via_server).read_text())


def test_jsonl_input_through_the_server(server, tmp_path):
    photo = (SAMPLES / "sticker_rgba.png").read_bytes()
    data_url = "data:image/png;base64," + base64.b64encode(photo).decode()
    shutil.copy(SAMPLES / "grayscale.png", tmp_path / "gray.png")
    lines = [
        {"custom_id": "inline", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What is red?"}]}],
             "max_tokens": 3}},
        {"custom_id": "by-path", "body": {"messages": [
            {"role": "system", "content": "You describe images."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gray.png"}}]}]}},
        {"custom_id": "two-images", "body": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": "gray.png"}}]}]}},
        {"custom_id": "broken-base64", "body": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}},
    ]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    summary = _server_run(server.target, JobSpec("ocr", max_new_tokens=5), source, output)
    assert (summary.ok, summary.errors) == (3, 1)
    rows = _by_id(output)
    assert rows["inline"]["tokens"]["completion"] == 3  # the row's own max_tokens wins
    assert rows["by-path"]["tokens"]["completion"] == 5
    assert rows["two-images"]["tokens"]["image"] == rows["inline"]["tokens"]["image"] + rows["by-path"]["tokens"][
        "image"]
    assert "base64" in rows["broken-base64"]["error"] and rows["broken-base64"]["transient"] is False


def test_transient_failures_are_recorded_then_retried_by_resume(server, images, tmp_path):
    """A server that goes away mid-job: its items become transient rows (exit 75), too many in a
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
            return await Job(spec, load_items(images), output, backend, resume=True, options=options).run()
        finally:
            await backend.close()

    summary = asyncio.run(against_a_vanishing_server(None))
    assert (summary.ok, summary.transient, summary.exit_code) == (0, len(GOOD + BAD), 75)
    assert all(r["transient"] and r["error"].startswith("server UNAVAILABLE") for r in _rows(output))
    assert "rerun with --resume to retry the transient failures" in summary.line(output)

    output.unlink()
    stopped = asyncio.run(against_a_vanishing_server(2))
    assert stopped.exit_code == 1 and stopped.transient == 2 and "2 transient failures in a row" in stopped.aborted

    summary = _server_run(server.target, spec, images, output, resume=True)
    assert summary.prior.retrying == 2 and summary.skipped == 0
    assert (summary.ok, summary.errors, summary.transient, summary.exit_code) == (len(GOOD), len(BAD), 0, 0)
    assert sorted(_by_id(output)) == sorted(GOOD + BAD)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "batch", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_rows(proc: subprocess.Popen, output: Path, rows: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if output.exists() and output.read_bytes().count(b"\n") >= rows:
            return
        time.sleep(0.02)


def test_ctrl_c_then_kill_9_then_resume_gives_every_input_exactly_once(server, tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(15):
        shutil.copy(SAMPLES / ("sticker_rgba.png" if i % 2 else "grayscale.png"), folder / f"img{i:02d}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    output = tmp_path / "out.jsonl"
    args = ["--task", "caption", "--input", str(folder), "--output", str(output), "--server", server.target,
            "--concurrency", "1", "--max-new-tokens", "8"]

    # Ctrl-C: stops cleanly (whole rows only, exit 130, says how to finish).
    proc = _start(args)
    _wait_for_rows(proc, output, 2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted: rerun with --resume" in stdout
    after_ctrl_c = output.read_bytes()
    assert after_ctrl_c.endswith(b"\n") and 2 <= after_ctrl_c.count(b"\n") < 16

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
    rows = _by_id(output)  # asserts no id twice
    assert sorted(rows) == sorted([f"img{i:02d}.png" for i in range(15)] + ["broken.png"])
    assert rows["broken.png"]["status"] == "error" and sum(r["status"] == "ok" for r in rows.values()) == 15


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


def test_embed_cli_in_process_writes_shards_equal_to_the_server(server, checkpoint, images, tmp_path):
    output = tmp_path / "emb.jsonl"
    done = _cli("--task", "embed", "--input", str(images), "--output", str(output), "--devices", "cpu:1")
    assert done.returncode == 0, done.stderr
    assert f"{len(GOOD)} ok, {len(BAD)} errors" in done.stdout
    rows = _by_id(output)
    assert sorted(rows) == sorted(GOOD + BAD)
    fp = json.loads(fingerprint_path(output).read_text())
    assert fp["task"] == "embed" and fp["model"] == checkpoint_fingerprint(checkpoint)

    via_server = tmp_path / "server.jsonl"
    _server_run(server.target, JobSpec("embed"), images, via_server)
    reference = _by_id(via_server)
    for name in GOOD:
        row = rows[name]
        emb = row["embedding"]
        tensor = load_file(str(output.parent / emb["file"]))[emb["key"]]
        assert list(tensor.shape) == emb["shape"] == [row["tokens"]["image"], 64] and emb["key"] == name
        ref = reference[name]["embedding"]
        expected = load_file(str(via_server.parent / ref["file"]))[ref["key"]]
        np.testing.assert_array_equal(tensor, expected)  # one path: the same rows, bit for bit
        assert row["grid_thw"] == reference[name]["grid_thw"]
    for name in BAD:  # decoded in an encoder worker here, in the server's process there: the same row
        assert rows[name]["status"] == "error" and "embedding" not in rows[name]
        assert rows[name]["error"] == reference[name]["error"] and rows[name]["error"].startswith("bad image: ")
    assert [p.name for p in shard_dir(output).iterdir()] == ["shard-00001.safetensors"]

    usage = _cli("--task", "embed", "--input", str(images), "--output", str(output), "--prompt", "x")
    assert usage.returncode == 2 and "do not apply to --task embed" in usage.stderr
