"""The project's `mm_hash` equals every golden vLLM 0.33 computed (`../shared/conformance/vllm/`,
kept beside the repository, never copied into it): each file x model id x algorithm, and the
client-uuid cases."""

from __future__ import annotations

from conformance_data import needs_vllm_goldens, vllm_goldens, vllm_image

from service.epd.vllm_storage import item_key, mm_hash

pytestmark = needs_vllm_goldens


def test_every_golden_case() -> None:
    cases = vllm_goldens()["cases"]
    assert len(cases) == 48  # 8 files x 2 model ids x 3 algorithms
    for case in cases:
        got = mm_hash(vllm_image(case["file"]), case["model_id"], case["algorithm"])
        assert got == case["mm_hash"], case


def test_client_uuids_are_used_verbatim() -> None:
    for case in vllm_goldens()["client_uuid_cases"]:
        keys = [item_key(vllm_image(name), uuid, case["model_id"], case["algorithm"])
                for name, uuid in zip(case["request_images"], case["uuids"], strict=True)]
        assert keys == case["vllm_mm_hashes"]
