"""The service's pure parts: media_pad expansion, position ids, row splicing, the embedding cache,
the model identity, the vLLM encoder-cache files and the error taxonomy."""

from types import SimpleNamespace

import grpc
import pytest
import torch

from service import errors
from service.engine.cache import EmbedCache
from service.engine.identity import checkpoint_fingerprint, content_hash
from service.epd import vllm_storage as ec_export
from textcore.splice import Span, SpliceError, expand_media_pads, position_ids, splice_rows
from textcore.tokenizer import MEDIA_PAD_ID as PAD
from vision import ImageOptions


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
    opts, capped = ImageOptions(), ImageOptions(max_tokens=8)
    base = content_hash(b"img", opts, "ck1")
    assert base == content_hash(b"img", ImageOptions(), "ck1")
    assert len({base, content_hash(b"img2", opts, "ck1"), content_hash(b"img", capped, "ck1"),
                content_hash(b"img", opts, "ck2")}) == 4


def test_checkpoint_fingerprint_tells_seeds_apart(tmp_path):
    from safetensors.torch import save_file

    for name, seed in (("one", 0), ("two", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        save_file({"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))},
                  tmp_path / name / "model.safetensors")
    assert checkpoint_fingerprint(tmp_path / "one") == checkpoint_fingerprint(tmp_path / "one")
    assert checkpoint_fingerprint(tmp_path / "one") != checkpoint_fingerprint(tmp_path / "two")


def test_vllm_encoder_cache_layout(tmp_path):
    rows = torch.randn(5, 8).to(torch.bfloat16)
    path = ec_export.write_ec(tmp_path, "abc123", rows)
    assert path == tmp_path / "abc123" / "encoder_cache.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["ec_cache"]
        assert torch.equal(f.get_tensor("ec_cache"), rows)
    assert [p.name for p in (tmp_path / "abc123").iterdir()] == ["encoder_cache.safetensors"]  # no temp left
    for bad in ("../escape", "a/b", "ok\n", "", "x" * 129):
        with pytest.raises(ValueError, match="not a usable encoder-cache key"):
            ec_export.write_ec(tmp_path, bad, rows)
    assert [p.name for p in tmp_path.iterdir()] == ["abc123"]


def test_an_export_that_cannot_be_written_is_retryable(tmp_path):
    """A file where the key's directory belongs (or a full disk) is the operator's to mend: 503, not 500."""
    from service.errors import Unavailable

    (tmp_path / "abc123").write_bytes(b"in the way")
    with pytest.raises(Unavailable, match="cannot write the encoder-cache entry for image"):
        ec_export.write_ec(tmp_path, "abc123", torch.zeros(2, 4))
    assert (tmp_path / "abc123").read_bytes() == b"in the way"


def test_error_taxonomy_is_one_table():
    """Every failure has a kind; the kind alone decides the gRPC code, the HTTP status and whether a
    batch job retries it."""
    from service.engine.pool import EncodeError, PoolClosedError, WorkerDiedError
    from textcore.chat import ChatError
    from vision.errors import ImageDecodeError, ImageOptionsError, ImageTooLargeError, UnsupportedMediaError

    K, G = errors.Kind, grpc.StatusCode
    cases = [
        (errors.BadRequest("x"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (errors.TooLarge("x"), K.TOO_LARGE, G.INVALID_ARGUMENT, 413, False),
        (errors.Unsupported("x"), K.UNSUPPORTED, G.UNIMPLEMENTED, 400, False),
        (errors.NotConfigured("x"), K.NOT_CONFIGURED, G.FAILED_PRECONDITION, 400, False),
        (errors.NotFound("x"), K.NOT_FOUND, G.NOT_FOUND, 404, False),
        (errors.Overloaded("x"), K.OVERLOADED, G.RESOURCE_EXHAUSTED, 429, True),
        (errors.Unavailable("x"), K.UNAVAILABLE, G.UNAVAILABLE, 503, True),
        (ImageDecodeError("truncated"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (ImageOptionsError("resize"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (ImageTooLargeError("pixels"), K.TOO_LARGE, G.INVALID_ARGUMENT, 413, False),
        (UnsupportedMediaError("video"), K.UNSUPPORTED, G.UNIMPLEMENTED, 400, False),
        (ChatError("role"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (SpliceError("pads"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (WorkerDiedError("died"), K.UNAVAILABLE, G.UNAVAILABLE, 503, True),
        (PoolClosedError("closed"), K.UNAVAILABLE, G.UNAVAILABLE, 503, True),
        (EncodeError("boom"), K.INTERNAL, G.INTERNAL, 500, True),
        (TimeoutError(), K.DEADLINE, G.DEADLINE_EXCEEDED, 504, True),
        (errors.RemoteError(G.INVALID_ARGUMENT, "bad image: x"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400, False),
        (errors.RemoteError(G.UNKNOWN, "?"), K.INTERNAL, G.INTERNAL, 500, True),
        # The kind a server names in its trailing metadata, when it has that status code.
        (errors.RemoteError(G.INVALID_ARGUMENT, "too big", kind="too_large"), K.TOO_LARGE, G.INVALID_ARGUMENT, 413,
         False),
        (errors.RemoteError(G.UNAVAILABLE, "x", kind="too_large"), K.UNAVAILABLE, G.UNAVAILABLE, 503, True),
        (errors.RemoteError(G.INVALID_ARGUMENT, "x", kind="no such kind"), K.BAD_INPUT, G.INVALID_ARGUMENT, 400,
         False),
    ]
    for exc, kind, code, http, retry in cases:
        failure = errors.classify(exc)
        assert failure is not None and failure.kind == kind, exc
        assert (failure.rule.grpc, failure.rule.http, failure.rule.retry) == (code, http, retry), exc
    assert errors.classify(ImageDecodeError("truncated")).message == "bad image: truncated"
    assert errors.classify(ChatError("role")).message == "bad chat: role"
    assert errors.classify(UnsupportedMediaError("video")).message == "video"
    assert errors.classify(errors.RemoteError(G.UNAVAILABLE, "draining")).message == "server UNAVAILABLE: draining"
    assert errors.classify(RuntimeError("a bug")) is None  # no kind: a bug
    failure = errors.failure_for(RuntimeError("secret internals"))
    assert failure.kind == K.INTERNAL and "secret" not in failure.message and "ref" in failure.message
    assert set(errors.RULES) == set(errors.Kind)
    # What HTTP itself answers is a kind too: one table for every route's status and OpenAI type.
    for exc, http, openai_type, closes in [(errors.SlowClient("x"), 408, "timeout_error", True),
                                           (errors.HeadersTooLarge("x"), 431, "invalid_request_error", True),
                                           (errors.MethodNotAllowed("x"), 405, "invalid_request_error", False),
                                           (errors.Unauthenticated("x"), 401, "authentication_error", False)]:
        rule = errors.classify(exc).rule
        assert (rule.http, rule.openai_type, rule.closes) == (http, openai_type, closes), exc
