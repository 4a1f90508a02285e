"""The project's `mm_hash` equals every golden vLLM 0.33 computed (`../shared/conformance/vllm/`,
kept beside the repository, never copied into it): each file x model id x algorithm, and the
client-uuid cases."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from service.engine.vllm_ec import item_key, mm_hash

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDENS = Path(os.environ.get("KIMI_VLLM_CONFORMANCE_DIR", REPO_ROOT.parent / "shared" / "conformance" / "vllm"))
pytestmark = pytest.mark.skipif(not (GOLDENS / "hashes.json").is_file(),
                                reason=f"vLLM goldens not found at {GOLDENS} (kept beside the repository)")


def _goldens() -> dict:
    return json.loads((GOLDENS / "hashes.json").read_text())


def _image(name: str) -> bytes:
    data = (GOLDENS / name).read_bytes()
    meta = next(m for m in _goldens()["images"] if m["file"] == name)
    assert hashlib.sha256(data).hexdigest() == meta["sha256_of_file"], f"{name} is not the file vLLM hashed"
    return data


def test_every_golden_case() -> None:
    cases = _goldens()["cases"]
    assert len(cases) == 48  # 8 files x 2 model ids x 3 algorithms
    for case in cases:
        got = mm_hash(_image(case["file"]), case["model_id"], case["algorithm"])
        assert got == case["mm_hash"], case


def test_client_uuids_are_used_verbatim() -> None:
    for case in _goldens()["client_uuid_cases"]:
        keys = [item_key(_image(name), uuid, case["model_id"], case["algorithm"])
                for name, uuid in zip(case["request_images"], case["uuids"], strict=True)]
        assert keys == case["vllm_mm_hashes"]
