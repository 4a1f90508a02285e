"""The service's pure parts: media_pad expansion, position ids, row splicing, the embedding cache,
the vLLM encoder-cache files and the error mapping."""

from types import SimpleNamespace

import grpc
import pytest
import torch

from service import ec_export, errors
from service.embed_cache import EmbedCache, checkpoint_identity, content_hash
from service.splice import Span, SpliceError, expand_media_pads, position_ids, splice_rows

PAD = 163605


def test_expand_media_pads_several_images():
    ids = [1, PAD, 2, 3, PAD, PAD, 4]
    expanded = expand_media_pads(ids, [3, 1, 2])
    assert expanded.input_ids == [1, PAD, PAD, PAD, 2, 3, PAD, PAD, PAD, 4]
    assert expanded.spans == [Span(1, 3), Span(6, 1), Span(7, 2)]


def test_expand_media_pads_refuses_a_mismatch():
    with pytest.raises(SpliceError, match="2 media_pad tokens but 1 images"):
        expand_media_pads([PAD, 5, PAD], [4])
    with pytest.raises(SpliceError, match="at least one token"):
        expand_media_pads([PAD], [0])


def test_position_ids_are_relaid_over_the_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_splice_rows_replaces_only_the_spans():
    text = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    a, b = torch.full((2, 4), -1.0), torch.full((3, 4), -2.0)
    out = splice_rows(text, [Span(1, 2), Span(6, 3)], [a, b])
    assert torch.equal(out[1:3], a) and torch.equal(out[6:9], b)
    keep = [0, 3, 4, 5, 9]
    assert torch.equal(out[keep], text[keep])
    assert torch.equal(text, torch.arange(40, dtype=torch.float32).reshape(10, 4))  # input untouched
    with pytest.raises(SpliceError, match="do not fit"):
        splice_rows(text, [Span(1, 2)], [b])


def _entry(rows: int) -> SimpleNamespace:
    return SimpleNamespace(rows=torch.zeros(rows, 4))  # 16 bytes per row


def test_embed_cache_is_lru_and_bounded_in_bytes():
    cache = EmbedCache(max_bytes=100)
    cache.put("a", _entry(2))  # 32 B
    cache.put("b", _entry(2))
    cache.put("c", _entry(2))  # 96 B in all
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", _entry(2))  # over budget: evicts b (least recent), not a
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("d") is not None
    assert cache.nbytes == 96 and len(cache) == 3
    cache.put("huge", _entry(10))  # larger than the budget: not stored, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3
    disabled = EmbedCache(0)
    disabled.put("x", _entry(1))
    assert disabled.get("x") is None and disabled.nbytes == 0


def test_content_hash_covers_bytes_options_and_checkpoint():
    base = content_hash(b"img", "opts", "ck1")
    assert base == content_hash(b"img", "opts", "ck1")
    assert len({base, content_hash(b"img2", "opts", "ck1"), content_hash(b"img", "opts2", "ck1"),
                content_hash(b"img", "opts", "ck2")}) == 4


def test_checkpoint_identity_tells_seeds_apart(tmp_path):
    from safetensors.torch import save_file

    for name, seed in (("one", 0), ("two", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        save_file({"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))},
                  tmp_path / name / "model.safetensors")
    assert checkpoint_identity(tmp_path / "one") == checkpoint_identity(tmp_path / "one")
    assert checkpoint_identity(tmp_path / "one") != checkpoint_identity(tmp_path / "two")


def test_vllm_encoder_cache_layout(tmp_path):
    rows = torch.randn(5, 8).to(torch.bfloat16)
    path = ec_export.write_ec(tmp_path, "abc123", rows)
    assert path == tmp_path / "abc123" / "encoder_cache.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["ec_cache"]
        assert torch.equal(f.get_tensor("ec_cache"), rows)
    assert [p.name for p in (tmp_path / "abc123").iterdir()] == ["encoder_cache.safetensors"]  # no temp left
    with pytest.raises(ValueError, match="hash"):
        ec_export.write_ec(tmp_path, "../escape", rows)


def test_error_mapping_is_one_table():
    from textcore.chat import ChatError
    from vision.errors import ImageDecodeError, UnsupportedMediaError
    from vision.pool import PoolClosedError, WorkerDiedError

    cases = [
        (errors.BadRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (ImageDecodeError("truncated"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnsupportedMediaError("video"), grpc.StatusCode.UNIMPLEMENTED),
        (ChatError("role"), grpc.StatusCode.INVALID_ARGUMENT),
        (WorkerDiedError("died"), grpc.StatusCode.UNAVAILABLE),
        (PoolClosedError("closed"), grpc.StatusCode.UNAVAILABLE),
        (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    ]
    for exc, code in cases:
        assert errors.status_for(exc)[0] == code, exc
    code, message = errors.status_for(RuntimeError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message and "ref" in message
