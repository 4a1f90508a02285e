"""Replacing a file atomically and durably: the one way the service writes a whole file (the vLLM
encoder-cache export, a batch job's fingerprint, its embedding shards).

The content goes to a temporary file in the target's directory (`.NAME.<pid>-<random>.tmp`), which
is fsynced and renamed over the target, then the directory is fsynced: a reader sees the old file
or the whole new one, and after a crash the new one is either all there or not at all. With
`durable=False` the two fsyncs are left out: the rename still keeps a reader from ever seeing half
a file, but a power loss may lose the new file (the EC export: files on a request's path, where two
fsyncs per file would wait on the disk before the reply). On a failure the temporary file is
removed. With `replace=False` the target is never replaced: the temporary file is hard-linked to
the target's name, which fails if that name exists (so of two writers racing for one name exactly
one wins, and the other gets FileExistsError); the directory must be on a file system with hard
links (every local one, NFS). The file gets ordinary permissions, 0o666 masked by the process umask as `open()` gives,
even when the writer leaves a file of its own (safetensors' `save_file` writes its own temporary
file, 0600, and renames it into place).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "fsync_dir", "write_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a new or removed file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, durable: bool = True, replace: bool = True) -> Iterator[Path]:
    """A temporary path beside `target` (its directory made if missing) for the caller to write,
    as bytes or by a writer that takes a path; on leaving the block without an error it replaces
    `target` (see the module docstring), on an error it is removed. `durable=False`: atomic only,
    no fsync of the file or the directory (what survives a power loss is not promised).
    `replace=False`: an existing `target` is left as it is and FileExistsError raised."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)  # the writer may have put a file of its own there
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if replace:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)
            tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


def write_atomic(target: str | os.PathLike[str], data: bytes) -> None:
    """Replace `target` with `data`, atomically and durably."""
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)
