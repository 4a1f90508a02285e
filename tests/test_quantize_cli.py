"""`kimi-vision quantize`, run as a real process on a real checkpoint (the tiny MoonViT tower +
projector and the tiny KimiLinear trunk, bf16), and the memory of the quantised trunk once loaded."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from safetensors import safe_open
from torch import nn

from service.checkpoints.make import vision_part
from service.cli import main as cli_main
from textcore import mxfp4
from textcore.config import tiny
from textcore.model import MULTIMODAL_PREFIX, KimiLinearForCausalLM, random_weights
from vision.checkpoint import INDEX_FILE, Checkpoint, write_checkpoint

EXTRA_FILES = {"tiktoken.model": b"\x00\x01 not json \xff", "tokenizer_config.json": b'{"a": 1}\n'}
# What the release packs with the K3 config, by name (independent of the module code): the routed
# experts' w1/w2/w3 only (the latent MoE projections around them stay dense, docs/MODEL.md §12).
PACKED = re.compile(r"language_model\.model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]$")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "quantize", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source tensors, source dir, converted dir) for a multimodal bf16 checkpoint in several shards."""
    root = tmp_path_factory.mktemp("quantize")
    vision = vision_part("tiny", 0)
    tensors = {**vision.tensors, **random_weights(tiny(), seed=0, dtype=torch.bfloat16)}
    config = {**vision.config, "text_config": tiny().to_dict()}
    src = write_checkpoint(root / "bf16", tensors, config, json_files=vision.json_files, max_shard_bytes=8 << 20)
    for name, data in EXTRA_FILES.items():
        (src / name).write_bytes(data)
    result = _cli(src, root / "mxfp4", "--max-shard-bytes", str(6 << 20))
    assert result.returncode == 0, result.stderr
    return tensors, src, root / "mxfp4"


def test_converter_packs_what_the_config_targets_and_copies_the_rest(converted):
    tensors, src, out = converted
    ckpt = Checkpoint(out)
    assert ckpt.config == {**Checkpoint(src).config, "quantization_config": mxfp4.K3_QUANTIZATION_CONFIG}
    packed = {n.removesuffix(".weight") for n in tensors if PACKED.match(n.removesuffix(".weight"))}
    assert packed and all(".experts." in n for n in packed)
    assert any("routed_expert_up_proj" in n for n in tensors) and not any("routed_expert" in n for n in packed)
    for name in packed:
        q, s = mxfp4.quantize(tensors[f"{name}.weight"])
        assert torch.equal(ckpt.tensor(f"{name}.weight_packed"), q) and torch.equal(
            ckpt.tensor(f"{name}.weight_scale"), s
        )
    kept = set(tensors) - {f"{n}.weight" for n in packed}
    assert set(ckpt.names()) == kept | {f"{n}.{s}" for n in packed for s in ("weight_packed", "weight_scale")}
    for name in kept:  # attention, shared experts, dense FFN, router, lm_head, embeddings, vision, projector
        assert torch.equal(ckpt.tensor(name), tensors[name]), name
    for name in [*EXTRA_FILES, "preprocessor_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_converter_writes_a_correct_index(converted):
    _, _, out = converted
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    found, total = {}, 0
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                found[name] = shard
                total += t.numel() * t.element_size()
    assert found == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_loaded_trunk_keeps_routed_experts_packed(converted):
    tensors, _, out = converted
    model = KimiLinearForCausalLM.from_checkpoint(out)
    experts = {
        n: m for n, m in model.named_modules() if ".experts." in n and isinstance(m, (nn.Linear, mxfp4.MXFP4Linear))
    }
    assert experts and all(isinstance(m, mxfp4.MXFP4Linear) for m in experts.values())
    # Count each storage once: after loading, one layer's experts are views of one stacked storage.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in experts.values() for t in m.state_dict().values()}
    held = sum(storages.values())
    as_bf16 = sum(m.out_features * m.in_features * 2 for m in experts.values())
    assert held / as_bf16 == pytest.approx(4.25 / 16, rel=1e-9)  # measured on the loaded buffers
    assert not any(t.is_floating_point() for m in experts.values() for t in m.state_dict().values())
    # The loaded layers compute with exactly the weights the converter packed ...
    name, layer = next(iter(experts.items()))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = mxfp4.dequantize(*mxfp4.quantize(tensors[f"{MULTIMODAL_PREFIX}{name}.weight"])).float()
    torch.testing.assert_close(layer(x).float(), x.float() @ w.T, rtol=2**-8, atol=1e-6)
    # ... and exactly the targeted layers are packed; the rest stays bf16.
    for name, m in model.named_modules():
        if isinstance(m, mxfp4.MXFP4Linear):
            assert PACKED.match(MULTIMODAL_PREFIX + name), name
        elif isinstance(m, nn.Linear):
            assert not PACKED.match(MULTIMODAL_PREFIX + name) and m.weight.dtype == torch.bfloat16, name


def test_converter_refuses_bad_inputs_with_clear_errors(converted, tmp_path, capsys):
    _, src, out = converted
    cases = [
        ((src, out), f"{out} exists and is not an empty directory"),
        ((out, tmp_path / "again"), "already quantized"),
        ((tmp_path / "missing", tmp_path / "x"), "checkpoint directory not found"),
    ]
    unknown = write_checkpoint(tmp_path / "unknown", {"m.w1.weight": torch.ones(32, 48)}, {"model_type": "x"})
    cases.append(((unknown, tmp_path / "u_out"), "describes neither a KimiLinear trunk"))
    bad_config = tmp_path / "q.json"
    group = {**mxfp4.K3_QUANTIZATION_CONFIG["config_groups"]["group_0"], "format": "nvfp4-pack-quantized"}
    bad_config.write_text(json.dumps({**mxfp4.K3_QUANTIZATION_CONFIG, "config_groups": {"group_0": group}}))
    cases.append(((src, tmp_path / "y", "--config", bad_config), "only 'mxfp4-pack-quantized' is supported"))
    every_linear = tmp_path / "all.json"  # reaches layers narrower than a group (tiny low-rank projections)
    every_linear.write_text(json.dumps({**mxfp4.K3_QUANTIZATION_CONFIG, "ignore": []}))
    cases.append(((src, tmp_path / "z", "--config", every_linear), r"\.weight: in_features \d+ .* not divisible by 32"))
    damaged = tmp_path / "damaged"
    shutil.copytree(src, damaged)
    shard = sorted(damaged.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    cases.append(((damaged, tmp_path / "d_out"), "cannot read the tensors of"))
    cases.append(((src, tmp_path / "w", "--max-shard-bytes", "0"), "must be positive"))
    for args, message in cases:  # in-process through the same entry point (a process start costs seconds)
        assert cli_main(["quantize", *map(str, args)]) == 2, args
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: ") and re.search(message, stderr), (message, stderr)
