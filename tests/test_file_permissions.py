"""Files the project writes get ordinary permissions, 0666 for files and 0777 for directories less
the umask (what `open()` and `mkdir()` give): a checkpoint made by one user (an image's build, as
root) is read by another (the image's uid 10001), and so is a mounted checkpoint or an embeddings
file. safetensors' `save_file` alone leaves 0600 files, `tempfile.mkdtemp` 0700 directories."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from PIL import Image

from service.checkpoints.default import generator_key
from vision.checkpoint import INDEX_FILE

OTHER_UID = 65534  # nobody


def _cli(*args: str | Path, umask: int, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "service.cli", *map(str, args)], cwd=REPO_ROOT, umask=umask,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _modes(root: Path) -> dict[str, str]:
    """Every path at and under `root` (relative; "." for itself), with its permission bits in octal."""
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *sorted(root.rglob("*"))]}


def _ordinary(root: Path, umask: int) -> dict[str, str]:
    """What `_modes(root)` is when every directory and file has ordinary permissions under `umask`."""
    return {str(p.relative_to(root)): oct((0o777 if p.is_dir() else 0o666) & ~umask)
            for p in [root, *sorted(root.rglob("*"))]}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_make_checkpoint_and_quantize_honour_the_umask(tmp_path, umask):
    src, out = tmp_path / "bf16", tmp_path / "mxfp4"
    _cli("make-checkpoint", "--bf16", src, umask=umask)
    assert any(name.endswith(".safetensors") for name in _modes(src))
    assert _modes(src) == _ordinary(src, umask)
    extra = src / "chat_template.jinja"  # a file of the source's own, kept private: the copy is still ordinary
    extra.write_text("{{ messages }}")
    extra.chmod(0o600)
    private = src / "assets" / "inner"  # a directory tree of its own, kept private: its copy is still ordinary
    private.mkdir(parents=True)
    (private / "vocab.txt").write_text("a b c")
    for directory in (private, private.parent):
        directory.chmod(0o700)
    _cli("quantize", src, out, umask=umask)
    assert "chat_template.jinja" in _modes(out) and INDEX_FILE in _modes(out)
    assert (out / "assets" / "inner" / "vocab.txt").read_text() == "a b c"
    assert _modes(out) == _ordinary(out, umask)


def test_embed_output_is_ordinary(tmp_path):
    checkpoint, image = tmp_path / "ckpt", tmp_path / "a.png"
    _cli("make-checkpoint", checkpoint, umask=0o022)
    Image.new("RGB", (28, 28), (9, 99, 199)).save(image)
    _cli("embed", "--checkpoint", checkpoint, "--workers", "1", "--out", tmp_path / "out" / "rows.safetensors", image,
         umask=0o027)
    assert _modes(tmp_path / "out") == {".": "0o750", "rows.safetensors": "0o640"}


def test_another_user_reads_the_default_checkpoint():
    """What the image does: the default checkpoint built by root under umask 022, then read by another
    uid (here every file, by `cat` running as nobody)."""
    parent = Path(tempfile.mkdtemp(prefix="kimi-vision-modes-"))  # not under pytest's 0700 tmp root
    try:
        parent.chmod(0o755)
        cache = parent / "models"
        code = "from service.checkpoints.default import default_checkpoint_dir as d; print(d())"
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, umask=0o022, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "KIMI_VISION_CACHE": str(cache)})
        assert done.returncode == 0, done.stderr
        built = cache / generator_key()
        assert done.stdout.strip() == str(built)
        assert _modes(cache) == _ordinary(cache, 0o022)
        if os.geteuid() != 0:
            pytest.skip("the modes are ordinary; reading them as another uid needs root to start that process")
        files = sorted(built.iterdir())
        read = subprocess.run(["cat", *map(str, files)], user=OTHER_UID, group=OTHER_UID, extra_groups=[],
                              capture_output=True, timeout=60)
        assert read.returncode == 0, read.stderr
        assert read.stdout == b"".join(p.read_bytes() for p in files)
    finally:
        shutil.rmtree(parent)
