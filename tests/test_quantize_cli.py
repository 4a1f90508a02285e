"""`kimi-vision quantize`, run as a real process on real checkpoint directories, and the memory of
a quantised checkpoint once loaded."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from k3_module_tree import k3_like_tree, routed_expert_names
from safetensors import safe_open

from service.cli import main as cli_main
from textcore import mxfp4
from vision.checkpoint import INDEX_FILE, Checkpoint, write_checkpoint

CONFIG = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "hidden_size": 64}}
EXTRA_FILES = {"tiktoken.model": b"\x00\x01 not json \xff", "tokenizer_config.json": b'{"a": 1}\n'}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "quantize", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source tensors, source dir, converted dir): the K3-like tree in bf16, several shards."""
    root = tmp_path_factory.mktemp("quantize")
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in k3_like_tree().state_dict().items()}
    src = write_checkpoint(root / "bf16", tensors, CONFIG, max_shard_bytes=40_000)
    for name, data in EXTRA_FILES.items():
        (src / name).write_bytes(data)
    result = _cli(src, root / "mxfp4", "--max-shard-bytes", "30000")
    assert result.returncode == 0, result.stderr
    assert "quantized 24 linear layers" in result.stdout
    return tensors, src, root / "mxfp4"


def test_converter_packs_the_routed_experts_and_copies_the_rest(converted):
    tensors, _, out = converted
    ckpt = Checkpoint(out)
    assert ckpt.config == {**CONFIG, "quantization_config": mxfp4.K3_QUANTIZATION_CONFIG}
    experts = routed_expert_names()
    for name in experts:
        packed, scale = mxfp4.quantize(tensors[f"{name}.weight"])
        assert torch.equal(ckpt.tensor(f"{name}.weight_packed"), packed)
        assert torch.equal(ckpt.tensor(f"{name}.weight_scale"), scale)
    kept = set(tensors) - {f"{n}.weight" for n in experts}
    assert set(ckpt.names()) == kept | {f"{n}.{s}" for n in experts for s in ("weight_packed", "weight_scale")}
    for name in kept:
        assert torch.equal(ckpt.tensor(name), tensors[name]), name
    for name, data in EXTRA_FILES.items():
        assert (out / name).read_bytes() == data


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


def test_loaded_checkpoint_keeps_routed_experts_packed(converted):
    tensors, _, out = converted
    ckpt = Checkpoint(out)
    tree = k3_like_tree(device="meta")
    swapped = mxfp4.apply_quantization_config(tree, ckpt.config["quantization_config"])
    ckpt.load_into(tree, "")
    assert swapped == routed_expert_names()
    held = bf16 = 0
    for name in swapped:
        layer = tree.get_submodule(name)
        assert all(not t.is_floating_point() for t in layer.state_dict().values()), name
        held += sum(t.untyped_storage().nbytes() for t in (layer.weight_packed, layer.weight_scale))
        bf16 += layer.out_features * layer.in_features * 2
    assert held / bf16 == pytest.approx(4.25 / 16, rel=1e-6)
    # ... and the loaded layers compute with the weights the converter packed.
    name = swapped[5]
    x = torch.randn(3, tree.get_submodule(name).in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = x.float() @ mxfp4.dequantize(*mxfp4.quantize(tensors[f"{name}.weight"])).float().T
    torch.testing.assert_close(tree.get_submodule(name)(x).float(), reference, rtol=2**-8, atol=1e-6)
    attention = tree.language_model.model.layers[1].self_attn.q_proj
    assert attention.weight.dtype == torch.bfloat16 and torch.equal(
        attention.weight, tensors["language_model.model.layers.1.self_attn.q_proj.weight"]
    )


def test_converter_refuses_bad_inputs_with_clear_errors(converted, tmp_path, capsys):
    _, src, out = converted
    cases = [
        ((src, out), f"{out} exists and is not an empty directory"),
        ((out, tmp_path / "again"), "already quantized"),
        ((tmp_path / "missing", tmp_path / "x"), "checkpoint directory not found"),
    ]
    odd = write_checkpoint(tmp_path / "odd", {"m.experts.0.w1.weight": torch.ones(32, 48)}, {})
    cases.append(((odd, tmp_path / "odd_out"), "m.experts.0.w1.weight: in_features 48 .* not divisible by 32"))
    bad_config = tmp_path / "q.json"
    group = {**mxfp4.K3_QUANTIZATION_CONFIG["config_groups"]["group_0"], "format": "nvfp4-pack-quantized"}
    bad_config.write_text(json.dumps({**mxfp4.K3_QUANTIZATION_CONFIG, "config_groups": {"group_0": group}}))
    cases.append(((src, tmp_path / "y", "--config", bad_config), "only 'mxfp4-pack-quantized' is supported"))
    for args, message in cases:  # in-process through the same entry point (a process start costs seconds)
        assert cli_main(["quantize", *map(str, args)]) == 2, args
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: ") and re.search(message, stderr), (message, stderr)
