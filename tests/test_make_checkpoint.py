"""Checkpoint format (release tensor names, config files), the tiny generator, loader errors,
the embedded default checkpoint and the make-checkpoint CLI."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.checkpoints.make import CheckpointPart, make_checkpoint, merge_parts, vision_part
from service.cli import main as cli_main
from vision.checkpoint import Checkpoint, CheckpointError, write_checkpoint
from vision.config import PRESETS, VisionConfig
from vision.encoder import VisionEncoder
from vision.projector import Projector
from vision.tower import VisionTower

# docs/MODEL.md §3: the release's processor config.
RELEASE_MEDIA_PROC_CFG = {
    "in_patch_limit": 65536,
    "patch_size": 14,
    "merge_kernel_size": 2,
    "patch_limit_on_one_side": 512,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit_each_frame": 16384,
    "sample_fps": 8.0,
    "temporal_merge_kernel_size": 4,
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
}


def release_names(layers: int, d: int, q: int, i: int, text: int, grid: int = 64) -> dict[str, tuple[int, ...]]:
    """The release's vision tensor names and shapes (NeMo Automodel kimi_k3/vision.py, ROCm ATOM
    kimi_k3_vl.py; 163 `vision_tower.encoder.*` + 2 `patch_embed` + 3 `mm_projector` tensors at k3)."""
    names = {
        "vision_tower.patch_embed.proj.weight": (d, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (grid, grid, d),
        "vision_tower.encoder.final_layernorm.weight": (d,),
        "mm_projector.proj.0.weight": (4 * d, 4 * d),
        "mm_projector.proj.2.weight": (text, 4 * d),
        "mm_projector.post_norm.weight": (text,),
    }
    for b in range(layers):
        p = f"vision_tower.encoder.blocks.{b}."
        names |= {
            p + "norm0.weight": (d,),
            p + "wqkv.weight": (3 * q, d),
            p + "wo.weight": (d, q),
            p + "norm1.weight": (d,),
            p + "mlp.fc0.weight": (i, d),
            p + "mlp.fc1.weight": (d, i),
        }
    return names


def module_names(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        tower, projector = VisionTower(cfg), Projector(cfg)
    out = {"vision_tower." + k: tuple(v.shape) for k, v in tower.state_dict().items()}
    return out | {"mm_projector." + k: tuple(v.shape) for k, v in projector.state_dict().items()}


def test_k3_module_names_are_the_release_names():
    expected = release_names(layers=27, d=1024, q=1536, i=4096, text=7168)
    assert module_names(PRESETS["k3"]) == expected
    assert sum(n.startswith("vision_tower.encoder.") for n in expected) == 163


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", "tiny", seed=0)


def test_tiny_layout(tiny_dir):
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "preprocessor_config.json",
        "tiktoken.model",
        "tokenizer_config.json",
    ]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert VisionConfig.from_checkpoint_config(config) == PRESETS["tiny"]
    assert config["text_config"]["hidden_size"] == PRESETS["tiny"].text_hidden_size
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    written = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert written == {"media_proc_cfg": RELEASE_MEDIA_PROC_CFG}
    assert config["media_placeholder_token_id"] == 163605  # docs/MODEL.md §13
    ckpt = Checkpoint(tiny_dir)
    t = PRESETS["tiny"]
    expected = release_names(t.vt_num_hidden_layers, t.vt_hidden_size, t.qkv_hidden_size, 128, t.text_hidden_size)
    vision_names = [n for n in ckpt.names() if not n.startswith("language_model.")]
    assert {n: ckpt.shape(n) for n in vision_names} == expected
    assert all(ckpt.tensor(n).dtype == torch.bfloat16 for n in expected)
    # As released: the routed experts are stored MXFP4-packed, never as a bf16 weight.
    packed = ckpt.names("language_model.model.layers.1.block_sparse_moe.experts.0.w1.")
    assert packed == [
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed",
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale",
    ]
    assert not any(".experts." in n and n.endswith(".weight") for n in ckpt.names())
    # ... and only they: the latent MoE projections around them stay dense, as in the release,
    # so NeMo Automodel's adapter and SGLang (which read them dense) load this checkpoint unchanged.
    packed_modules = {n.removesuffix(".weight_packed") for n in ckpt.names() if n.endswith(".weight_packed")}
    assert packed_modules and all(re.search(r"\.experts\.\d+\.w[123]$", n) for n in packed_modules)
    for layer in range(1, config["text_config"]["num_hidden_layers"]):  # every MoE layer
        for proj in ("routed_expert_down_proj", "routed_expert_up_proj"):
            name = f"language_model.model.layers.{layer}.block_sparse_moe.{proj}.weight"
            assert ckpt.tensor(name).dtype == torch.bfloat16, name


def test_bf16_checkpoint_quantizes_to_the_default(tmp_path):
    from service.checkpoints.make import make_checkpoint as make
    from textcore.mxfp4 import K3_QUANTIZATION_CONFIG, quantize_tensors

    bf16 = Checkpoint(make(tmp_path / "bf16", "tiny", seed=0, mxfp4=False))
    assert not any(n.endswith("weight_packed") for n in bf16.names())
    assert "quantization_config" not in bf16.config
    from service.checkpoints.make import packed_linears

    tensors = {n: bf16.tensor(n) for n in bf16.names()}
    packed = quantize_tensors(tensors, K3_QUANTIZATION_CONFIG,
                              linear_modules=packed_linears(bf16.config, K3_QUANTIZATION_CONFIG))
    default = load_file(make(tmp_path / "mx", "tiny", seed=0) / "model-00001-of-00001.safetensors")
    assert sorted(packed) == sorted(default)
    assert all(torch.equal(packed[n], default[n]) for n in default)


def test_deterministic_and_seeded(tiny_dir, tmp_path):
    again = make_checkpoint(tmp_path / "again", "tiny", seed=0)
    for f in tiny_dir.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = load_file(make_checkpoint(tmp_path / "seed1", "tiny", seed=1) / "model-00001-of-00001.safetensors")
    base = load_file(tiny_dir / "model-00001-of-00001.safetensors")
    assert not torch.equal(other["mm_projector.proj.0.weight"], base["mm_projector.proj.0.weight"])


def test_parts_plug_in_and_must_agree():
    vision = vision_part("tiny", 0)
    trunk = CheckpointPart(
        tensors={"language_model.model.norm.weight": torch.ones(64)},
        config={"text_config": {"hidden_size": 64}, "model_type": "kimi_k3"},
        files={"tiktoken.model": b"x"},
    )
    merged = merge_parts([vision, trunk])
    assert "language_model.model.norm.weight" in merged.tensors and merged.files == {"tiktoken.model": b"x"}
    assert VisionConfig.from_checkpoint_config(merged.config).text_hidden_size == 64
    with pytest.raises(ValueError, match="projector width 64 != text_config.hidden_size 128"):
        merge_parts([vision, CheckpointPart(config={"text_config": {"hidden_size": 128}})])
    with pytest.raises(ValueError, match="disagree on config"):
        merge_parts([vision, CheckpointPart(config={"model_type": "other"})])
    with pytest.raises(ValueError, match="disagree on tensors"):
        merge_parts([vision, vision_part("tiny", 1)])


def copy_with(src: Path, dst: Path, edit) -> Path:
    """Rewrite checkpoint `src` into `dst` with its tensors passed through `edit(dict)`."""
    ckpt = Checkpoint(src)
    tensors = {n: ckpt.tensor(n) for n in ckpt.names()}
    edit(tensors)
    json_files = {"preprocessor_config.json": ckpt.read_json("preprocessor_config.json")}
    return write_checkpoint(dst, tensors, ckpt.config, json_files=json_files)


def test_loader_error_missing_tensor(tiny_dir, tmp_path):
    bad = copy_with(tiny_dir, tmp_path / "bad", lambda t: t.pop("vision_tower.encoder.blocks.1.wo.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing tensors: vision_tower\.encoder\.blocks\.1\.wo\.weight"):
        VisionEncoder.from_checkpoint(bad)


def test_loader_error_wrong_shape_and_unexpected(tiny_dir, tmp_path):
    def edit(t):
        t["mm_projector.proj.2.weight"] = torch.zeros(65, 256, dtype=torch.bfloat16)
        t["mm_projector.extra.weight"] = torch.zeros(1)

    bad = copy_with(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        VisionEncoder.from_checkpoint(bad)
    assert "mm_projector.proj.2.weight [65, 256] (expected [64, 256])" in str(e.value)
    assert "unexpected tensors: mm_projector.extra.weight" in str(e.value)


def test_loader_error_unsupported_config(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["vision_config"]["norm_type"] = "layernorm"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported variants .*norm_type"):
        VisionEncoder.from_checkpoint(bad)


def test_loads_symlinked_snapshot_and_sharded(tiny_dir, tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(blobs / f.name)
    ckpt = Checkpoint(snap)
    sharded = write_checkpoint(
        tmp_path / "sharded",
        {n: ckpt.tensor(n) for n in ckpt.names()},
        ckpt.config,
        max_shard_bytes=64 * 1024,
    )
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    item = (np.random.default_rng(0).uniform(-1, 1, (24, 3, 14, 14)).astype(np.float32), (1, 4, 6))
    ref = VisionEncoder.from_checkpoint(tiny_dir).encode([item])[0]
    torch.testing.assert_close(VisionEncoder.from_checkpoint(snap).encode([item])[0], ref, rtol=0, atol=0)
    torch.testing.assert_close(VisionEncoder.from_checkpoint(sharded).encode([item])[0], ref, rtol=0, atol=0)


def test_cli_make_checkpoint(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["make-checkpoint", "--preset", "tiny", "--seed", "0", str(out)]) == 0
    assert "wrote tiny checkpoint" in capsys.readouterr().out
    assert cli_main(["make-checkpoint", str(out)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert cli_main(["make-checkpoint", "--preset", "huge", str(tmp_path / "x")]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err


def test_default_checkpoint_built_once_atomically(tmp_path, monkeypatch, capsys):
    from service.checkpoints.default import cache_root, default_checkpoint_dir

    monkeypatch.setenv("KIMI_VISION_CACHE", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_checkpoint_dir())) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 2 and results[0] == results[1]
    built = results[0]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]  # no temp dirs left behind
    assert capsys.readouterr().err.count("building the embedded tiny default checkpoint") in (1, 2)
    mtime = (built / "config.json").stat().st_mtime_ns
    assert default_checkpoint_dir() == built
    assert capsys.readouterr().err == ""  # second use: silent, no rebuild
    assert (built / "config.json").stat().st_mtime_ns == mtime
    VisionEncoder.from_checkpoint(built)

    monkeypatch.delenv("KIMI_VISION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kimi-vision"


def test_generator_version_keys_the_cache(monkeypatch):
    import service.checkpoints.make as mc
    from service.checkpoints.default import generator_key

    before = generator_key()
    monkeypatch.setattr(mc, "GENERATOR_VERSION", "vision-test")
    assert generator_key() != before
    monkeypatch.setattr(mc, "GENERATOR_VERSION", mc.GENERATOR_VERSION)
    monkeypatch.setattr(mc, "PARTS", [*mc.PARTS, save_file])  # a part added by a later issue
    assert generator_key() != before
