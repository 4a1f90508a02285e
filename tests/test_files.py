"""service.files: the one atomic file replacement, durable or not, and the writers that use it (the
vLLM encoder-cache export, not durable; a batch job's fingerprint, its embedding shards), on real
files."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_tensors
from safetensors.torch import save_file

from service.batch.journal import fingerprint_path, prepare, shard_dir
from service.batch.shards import ShardWriter
from service.engine.store import write_ec
from service.errors import BadRequest
from service.files import atomic_path, write_atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_bytes_replace_the_file_with_ordinary_permissions(tmp_path, umask_022):
    target = tmp_path / "new" / "dir" / "file.json"  # the directory is made
    write_atomic(target, b"first")
    assert target.read_bytes() == b"first" and _mode(target) == 0o644
    inode = os.stat(target).st_ino
    write_atomic(target, b"second")
    assert target.read_bytes() == b"second" and os.stat(target).st_ino != inode  # renamed over, not rewritten
    assert os.listdir(target.parent) == ["file.json"]
    os.umask(0o077)
    write_atomic(target, b"private")
    assert _mode(target) == 0o600  # the umask decides, as for open()


def test_a_writer_that_takes_a_path_gets_the_same_permissions(tmp_path, umask_022):
    """safetensors' save_file leaves a 0600 file of its own; the replacement is 0644 all the same."""
    loose = tmp_path / "loose.safetensors"
    save_file({"x": torch.arange(3)}, str(loose))
    assert _mode(loose) == 0o600  # what the helper has to mend
    target = tmp_path / "t.safetensors"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".t.safetensors.") and tmp.name.endswith(".tmp")
        save_file({"x": torch.arange(3)}, str(tmp))
    assert _mode(target) == 0o644
    assert load_file(str(target))["x"].tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["loose.safetensors", "t.safetensors"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "file"
    write_atomic(target, b"old")
    with pytest.raises(RuntimeError, match="writer failed"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    with pytest.raises(TypeError):  # the writer's own error, before it wrote anything
        write_atomic(target, "not bytes")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["file"]


@pytest.fixture
def fsyncs(tmp_path, monkeypatch) -> list[tuple[str, bool]]:
    """What each fsync reached (the real fsync still runs): a file or a directory, and whether
    `tmp_path / "f"` existed then."""
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        synced.append(("dir" if is_dir else "file", (tmp_path / "f").exists()))

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_the_file_and_then_its_directory_are_fsynced(tmp_path, fsyncs):
    """The temporary file before the rename, the directory after it."""
    write_atomic(tmp_path / "f", b"data")
    assert fsyncs == [("file", False), ("dir", True)]


def test_not_durable_is_atomic_without_an_fsync(tmp_path, fsyncs, umask_022):
    target = tmp_path / "f"
    write_atomic(target, b"old")
    fsyncs.clear()
    inode = os.stat(target).st_ino
    with atomic_path(target, durable=False) as tmp:
        save_file({"x": torch.arange(3)}, str(tmp))  # a writer's own 0600 file, as the EC export's
        assert target.read_bytes() == b"old"  # nothing replaced before the block ends
    assert load_file(str(target))["x"].tolist() == [0, 1, 2] and os.stat(target).st_ino != inode
    assert _mode(target) == 0o644 and os.listdir(tmp_path) == ["f"]
    with pytest.raises(RuntimeError, match="writer failed"), atomic_path(target, durable=False) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert load_file(str(target))["x"].tolist() == [0, 1, 2] and os.listdir(tmp_path) == ["f"]
    assert fsyncs == []
    write_ec(tmp_path / "ec", "abc123", torch.randn(3, 4))  # the EC export writes this way
    assert fsyncs == []


def test_every_writer_replaces_its_files_this_way(tmp_path, umask_022):
    """The EC export, the job's fingerprint and the shards: 0644 under umask 022, no temporary left."""
    ec = write_ec(tmp_path / "ec", "abc123", torch.randn(3, 4))
    assert _mode(ec) == 0o644 and os.listdir(ec.parent) == [ec.name]

    output = tmp_path / "job" / "out.jsonl"
    prepare(output, {"task": "embed"}, resume=False)
    assert _mode(fingerprint_path(output)) == 0o644

    rows: list[dict] = []
    shards = ShardWriter(output, rows.extend)
    body = {"embedding": {"key": "a"}, "grid_thw": [1, 2, 2]}
    shards.add("a", np.ones((1, 4), dtype=np.float32), {"custom_id": "a", "response": {"body": body}})
    shards.flush()
    (shard,) = shard_dir(output).iterdir()
    assert shard.name == "shard-00001.safetensors" and _mode(shard) == 0o644
    assert rows[0]["response"]["body"]["embedding"]["file"] == "out.jsonl.embeddings/shard-00001.safetensors"
    assert sorted(p.name for p in output.parent.iterdir()) == ["out.jsonl", "out.jsonl.embeddings",
                                                               "out.jsonl.job.json"]


def test_racing_writers_of_one_key_leave_one_complete_file_and_never_replace_it(tmp_path):
    """The EC export does not replace: of writers racing for one key exactly one links its file in;
    the others, with another image, are refused; with the same image, they get the key as usual."""
    rows = [torch.full((64, 32), float(i)).to(torch.bfloat16) for i in range(8)]
    start = threading.Barrier(len(rows))
    outcomes: list[object] = [None] * len(rows)

    def write(i: int, image: str) -> None:
        start.wait()
        try:
            outcomes[i] = write_ec(tmp_path, "raced", rows[i], image)
        except BadRequest as exc:
            outcomes[i] = exc

    for same_image in (False, True):
        key_dir = tmp_path / "raced"
        if key_dir.exists():
            shutil.rmtree(key_dir)
        threads = [threading.Thread(target=write, args=(i, "img" if same_image else f"img{i}"))
                   for i in range(len(rows))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        written = load_tensors(str(key_dir / "encoder_cache.safetensors"))["ec_cache"]
        assert os.listdir(key_dir) == ["encoder_cache.safetensors"]  # no temporary left
        refused = [o for o in outcomes if isinstance(o, BadRequest)]
        if same_image:
            assert refused == [] and outcomes == [key_dir / "encoder_cache.safetensors"] * len(rows)
            assert any(torch.equal(written, r) for r in rows)
        else:
            (winner,) = [i for i, o in enumerate(outcomes) if not isinstance(o, BadRequest)]
            assert torch.equal(written, rows[winner])
            assert len(refused) == len(rows) - 1
            assert all("already holds another image's embeddings" in str(e) for e in refused)


def test_an_existing_entry_is_kept_bit_for_bit(tmp_path):
    """A second write of the key, whatever it holds, leaves the first file's bytes as they were."""
    first = write_ec(tmp_path, "kept", torch.randn(5, 8).to(torch.bfloat16), "img-a")
    before, inode = first.read_bytes(), os.stat(first).st_ino
    write_ec(tmp_path, "kept", torch.randn(5, 8).to(torch.bfloat16), "img-a")  # same image: the key, as usual
    with pytest.raises(BadRequest, match="another image's embeddings"):
        write_ec(tmp_path, "kept", torch.randn(5, 8).to(torch.bfloat16), "img-b")
    with pytest.raises(BadRequest, match="bfloat16 rows, not float32"):
        write_ec(tmp_path, "kept", torch.randn(5, 8), "img-a")
    assert first.read_bytes() == before and os.stat(first).st_ino == inode
    with pytest.raises(FileExistsError), atomic_path(first, replace=False) as tmp:
        tmp.write_bytes(b"other")
    assert first.read_bytes() == before and os.listdir(first.parent) == [first.name]
