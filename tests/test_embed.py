"""Real preprocessing -> tower: rows == num_tokens for odd sizes; the `kimi-vision embed` CLI."""

from __future__ import annotations

import json

import pytest
import torch
from images import png
from safetensors import safe_open
from safetensors.torch import load_file

import vision
from service.checkpoints.make import make_checkpoint
from service.cli import main as cli_main
from vision.encoder import VisionEncoder


@pytest.mark.parametrize(
    "w,h,mode", [(225, 223, "RGB"), (1, 1, "RGB"), (29, 57, "RGBA"), (3, 100, "L"), (57, 29, "LA"), (899, 31, "RGB")]
)
def test_rows_equal_num_tokens_for_odd_sizes(tiny_encoder, w, h, mode):
    pre = vision.preprocess_image(png(w, h, mode=mode))
    (out,) = tiny_encoder.encode([pre])
    assert out.shape == (pre.num_tokens, tiny_encoder.config.text_hidden_size)
    assert pre.num_tokens == (pre.grid_thw[1] // 2) * (pre.grid_thw[2] // 2)
    assert torch.isfinite(out).all()


def test_cli_embed_with_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_VISION_CACHE", str(tmp_path / "cache"))
    a, b, bad = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "bad.png"
    a.write_bytes(png(225, 223, seed=1, mode="RGBA"))
    b.write_bytes(png(40, 90, seed=2, mode="RGB"))
    bad.write_bytes(b"not an image")
    out = tmp_path / "out.safetensors"
    rc = cli_main(["embed", "--workers", "1", "--out", str(out), str(a), str(b), str(bad), str(a)])
    captured = capsys.readouterr()
    assert rc == 2  # one input failed; the others are still written
    assert f"error: {bad}:" in captured.err
    assert "building the embedded tiny default checkpoint" in captured.err

    from service.checkpoints.default import default_checkpoint_dir

    reference = VisionEncoder.from_checkpoint(default_checkpoint_dir())
    with safe_open(out, framework="pt") as f:
        assert sorted(f.keys()) == sorted([str(a), str(b), f"{a}#2"])
        meta = json.loads(f.metadata()["kimi_vision"])
        for key, path in [(str(a), a), (str(b), b), (f"{a}#2", a)]:
            pre = vision.preprocess_image(path.read_bytes())
            emb = f.get_tensor(key)
            assert emb.shape == (pre.num_tokens, 64)
            assert meta[key] == {"grid_thw": list(pre.grid_thw), "tokens": pre.num_tokens, "prompt": pre.prompt}
            torch.testing.assert_close(emb, reference.encode([pre])[0], rtol=1e-5, atol=1e-5)


def test_cli_embed_bad_checkpoint(tmp_path, capsys):
    img = tmp_path / "a.png"
    img.write_bytes(png(28, 28))
    rc = cli_main(["embed", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o.safetensors"), str(img)])
    assert rc == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_cli_embed_workers_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["embed", "--workers", "0", "--out", "o.safetensors", "a.png"])
    assert exit_info.value.code == 2
    assert "kimi-vision embed: error: argument --workers: must be >= 1, got 0" in capsys.readouterr().err


def test_cli_embed_vllm_ec_layout(tmp_path, tiny_encoder, capsys):
    """`--format vllm-ec`: one `<mm_hash>/encoder_cache.safetensors` per image, named by the hash vLLM
    computes for it (here under a local-path model id and sha256, as `vllm serve /models/kimi-k3
    --mm-hasher-algorithm sha256` would), holding bfloat16 rows by default."""
    from service.engine.store import mm_hash

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, "tiny", seed=0)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png(60, 30, seed=3, mode="RGB"))
    b.write_bytes(png(30, 90, seed=4, mode="LA"))
    out = tmp_path / "ec"
    rc = cli_main(["embed", "--checkpoint", str(ckpt), "--workers", "1", "--format", "vllm-ec", "--out", str(out),
                   "--vllm-model-id", "/models/kimi-k3", "--mm-hasher-algorithm", "sha256", str(a), str(b)])
    assert rc == 0, capsys.readouterr().err
    hashes = {mm_hash(p.read_bytes(), "/models/kimi-k3", "sha256"): p for p in (a, b)}
    assert sorted(p.name for p in out.iterdir()) == sorted(hashes)  # <DIR>/<mm_hash>/encoder_cache.safetensors
    for h, path in hashes.items():
        assert [f.name for f in (out / h).iterdir()] == ["encoder_cache.safetensors"]
        pre = vision.preprocess_image(path.read_bytes())
        written = load_file(str(out / h / "encoder_cache.safetensors"))["ec_cache"]  # as vLLM's connector reads it
        assert written.dtype == torch.bfloat16  # what vLLM holds
        torch.testing.assert_close(written, tiny_encoder.encode([pre])[0].to(torch.bfloat16), rtol=1e-2, atol=1e-2)
