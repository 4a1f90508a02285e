"""The project's `mm_hash` equals every golden vLLM 0.33 computed (`../shared/conformance/vllm/`,
kept beside the repository, never copied into it): each file x model id x algorithm, and the
client-uuid cases; and the rules a client's uuid meets."""

from __future__ import annotations

import hashlib

import pytest
from conformance_data import needs_vllm_goldens, vllm_goldens, vllm_image

from service.engine.config import HASH_ALGORITHMS
from service.engine.store import hash_shaped, item_key, mm_hash
from service.errors import BadRequest
from service.media import item_uuid

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


def test_every_algorithms_hash_has_the_shape_a_uuid_may_take_only_as_the_items_own() -> None:
    """A uuid shaped like any of vLLM's hashes is refused unless it is the item's own mm_hash or
    the sha256 of its URL (vLLM's EPD proxy key), so no request takes another image's key."""
    mine, other = vllm_image("rgb_160x120.jpg"), vllm_image("rgba_97x61.png")
    url = "data:image/jpeg;base64,AAAA"
    for algorithm in HASH_ALGORITHMS:
        own, foreign = mm_hash(mine, "m", algorithm), mm_hash(other, "m", algorithm)
        assert hash_shaped(own) and hash_shaped(foreign)
        assert item_key(mine, own, "m", algorithm) == own
        with pytest.raises(BadRequest, match="form of a content hash but is not this image's own"):
            item_key(mine, foreign, "m", algorithm)
        with pytest.raises(BadRequest, match="form of a content hash"):
            item_key(mine, own.upper(), "m", algorithm)  # another directory name, not the image's key
    proxy_key = hashlib.sha256(url.encode()).hexdigest()
    assert item_key(mine, proxy_key, "m", url=url) == proxy_key
    with pytest.raises(BadRequest, match="form of a content hash"):
        item_key(mine, proxy_key, "m", url=url + "A")
    assert item_key(mine, "f" * 63, "m") == "f" * 63  # not a hash's length: a name like any other


def test_the_uuid_rule_refuses_what_is_not_one_plain_path_component() -> None:
    for bad in ("../x", "a/b", "a\x00b", "x" * 10_240, "okname\n", "", "x" * 129, "é", ".", 7, ["a"]):
        with pytest.raises(BadRequest, match="uuid must be 1 to 128 characters"):
            item_uuid(bad, "messages[0].content[0]")
    assert [item_uuid(good, "w") for good in ("a", "A-z_09", "x" * 128, None)] == ["a", "A-z_09", "x" * 128, None]
