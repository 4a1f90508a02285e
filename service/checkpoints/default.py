"""The embedded default model: a tiny random checkpoint, generated once into a user cache.

Commands that need a model and get no `--checkpoint` use it. The directory name carries the
generator version and the list of parts, so a changed generator builds a fresh one. It is built
in a temporary sibling and renamed into place, so a reader never sees a half-written checkpoint
and two processes racing to build it both end up using one complete copy. Its directories and
files get ordinary permissions (0755 and 0644 under umask 022): a container image builds it as
root and serves it as another user.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import sys
from pathlib import Path

from service.checkpoints import make

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0


def cache_root() -> Path:
    if os.environ.get("KIMI_VISION_CACHE"):
        return Path(os.environ["KIMI_VISION_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kimi-vision"


def generator_key() -> str:
    """Changes whenever the generator's output may change: its version or its list of parts."""
    parts = ",".join(f"{p.__module__}.{p.__qualname__}" for p in make.PARTS)
    version = make.GENERATOR_VERSION
    digest = hashlib.sha256(f"{version}|{parts}|{DEFAULT_PRESET}|{DEFAULT_SEED}".encode()).hexdigest()
    return f"{DEFAULT_PRESET}-{version}-{digest[:12]}"


def default_checkpoint_dir() -> Path:
    """Path of the embedded default checkpoint, building it first if this is the first use."""
    root = cache_root()
    target = root / generator_key()
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(f"kimi-vision: building the embedded {DEFAULT_PRESET} default checkpoint in {target} (once)", file=sys.stderr)
    # Not tempfile.mkdtemp: its directory is 0700, which only its maker may read.
    tmp = root / f".{target.name}.{os.getpid()}-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        make.make_checkpoint(tmp, preset=DEFAULT_PRESET, seed=DEFAULT_SEED)
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
