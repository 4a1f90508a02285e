"""Where the tests find the conformance data kept beside the repository (never copied into it):
`<repo>/../shared/conformance/{kimi-k3,vllm}/`, or the directories `$KIMI_K3_CONFORMANCE_DIR` and
`$KIMI_VLLM_CONFORMANCE_DIR` name (a clone elsewhere points at them). A test that needs data that
is absent skips, saying where it looked and which variable to set."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
K3_DIR = Path(os.environ.get("KIMI_K3_CONFORMANCE_DIR") or REPO_ROOT.parent / "shared" / "conformance" / "kimi-k3")
VLLM_DIR = Path(os.environ.get("KIMI_VLLM_CONFORMANCE_DIR") or REPO_ROOT.parent / "shared" / "conformance" / "vllm")

needs_vllm_goldens = pytest.mark.skipif(
    not (VLLM_DIR / "hashes.json").is_file(),
    reason=f"vLLM goldens not found at {VLLM_DIR}; set KIMI_VLLM_CONFORMANCE_DIR to the directory holding hashes.json")


def vllm_goldens() -> dict:
    """`hashes.json`: the mm_hash vLLM computed for each image x model id x algorithm."""
    return json.loads((VLLM_DIR / "hashes.json").read_text())


def vllm_image(name: str) -> bytes:
    """One of the golden images, checked to be the very file vLLM hashed."""
    data = (VLLM_DIR / name).read_bytes()
    meta = next(m for m in vllm_goldens()["images"] if m["file"] == name)
    assert hashlib.sha256(data).hexdigest() == meta["sha256_of_file"], f"{name} is not the file vLLM hashed"
    return data
