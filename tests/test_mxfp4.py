"""MXFP4 format, quantiser, torch path and the config-driven module swap (textcore.mxfp4)."""

import importlib
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from k3_module_tree import k3_like_tree, routed_expert_names
from torch import nn

from textcore import mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes to one code per column, independently of the module (low nibble first)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _decode_by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element decoder from the bit layout (sign | 2-bit exponent | 1-bit mantissa), in float64."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float64)
    for r in range(packed.shape[0]):
        for c in range(out.shape[1]):
            byte = int(packed[r, c // 2])
            code = byte & 15 if c % 2 == 0 else byte >> 4
            exp, mant = (code >> 1) & 3, code & 1
            mag = mant * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + mant / 2)
            s = int(scale[r, c // 32])
            value = math.nan if s == 255 else math.copysign(mag, -1.0 if code & 8 else 1.0) * 2.0 ** (s - 127)
            out[r, c] = value
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, with every NaN counted equal to every NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a[~nan_a].view(ints), b[~nan_b].view(ints))


def test_every_e2m1_code_round_trips():
    row = torch.tensor(E2M1 + [-v for v in E2M1] + [0.0] * 16)  # amax 6 -> scale 2^0
    packed, scale = mxfp4.quantize(row[None])
    assert scale.tolist() == [[127]]
    assert _codes(packed)[0, :16].tolist() == list(range(16))
    assert packed[0, 0] == 0x10  # low nibble is the even column
    back = mxfp4.dequantize(packed, scale, torch.float32)
    assert _same_bits(back[0], row)


@pytest.mark.parametrize(
    ("value", "code"),
    [(0.25, 0), (0.26, 1), (0.75, 2), (0.74, 1), (1.25, 2), (1.26, 3), (1.75, 4), (2.5, 4), (2.51, 5),
     (3.5, 6), (3.49, 5), (5.0, 6), (5.01, 7), (7.9, 7), (-0.75, 10), (-5.0, 14)],
)  # fmt: skip
def test_rounds_to_nearest_even_and_saturates(value, code):
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1] = 4.0, value  # amax in [4, 8) -> scale 2^0
    packed, scale = mxfp4.quantize(row)
    assert scale.item() == 127
    assert _codes(packed)[0, 1].item() == code


def test_sign_of_zero():
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([4.0, 0.0, -0.0, -0.1])
    packed, scale = mxfp4.quantize(row)
    assert _codes(packed)[0, :4].tolist() == [6, 0, 8, 8]  # -0 and a negative rounding to 0 keep the sign
    back = mxfp4.dequantize(packed, scale, torch.float32)[0]
    assert back[1] == 0 and not torch.signbit(back[1])
    assert back[2] == 0 and torch.signbit(back[2]) and torch.signbit(back[3])


def test_scale_exponent_rule_and_clamping():
    w = torch.zeros(5, 32)
    w[0, 0] = 1.0  # floor(log2 1) - 2 = -2
    w[1, 0] = 7.99  # floor(log2 7.99) - 2 = 0
    w[2, 0] = 2.0**-126  # -128, clamped to -127: code 0, and the element becomes 2 * 2^-127
    w[3, 0] = torch.finfo(torch.float32).max  # 127 - 2 = 125: the largest a finite weight reaches
    # row 4 stays all zero: code 0
    packed, scale = mxfp4.quantize(w)
    assert scale[:, 0].tolist() == [125, 127, 0, 252, 0]
    assert _codes(packed)[:, 0].tolist() == [6, 7, 4, 7, 0]
    back = mxfp4.dequantize(packed, scale, torch.float32)
    assert back[2, 0].item() == 2.0**-126
    assert back[3, 0].item() == 6.0 * 2.0**125


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_rejected(bad):
    w = torch.ones(2, 64, dtype=torch.bfloat16)
    w[1, 40] = bad
    with pytest.raises(mxfp4.MXFP4Error, match=r"NaN/Inf.*first at \[1, 40\]"):
        mxfp4.quantize(w)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (torch.ones(4, 48), "not divisible by 32"),
        (torch.ones(4, 31), "not divisible by 32"),
        (torch.ones(64), "2-D"),
        (torch.ones(2, 2, 32), "2-D"),
        (torch.ones(2, 32, dtype=torch.int32), "floating-point"),
        (torch.ones(2, 32, device="meta"), "meta"),
    ],
)
def test_bad_shapes_and_dtypes_are_rejected(w, message):
    with pytest.raises(mxfp4.MXFP4Error, match=message):
        mxfp4.quantize(w)


def test_bad_packed_inputs_are_rejected():
    packed, scale = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(mxfp4.MXFP4Error, match="does not match"):
        mxfp4.dequantize(packed, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(mxfp4.MXFP4Error, match="uint8"):
        mxfp4.dequantize(packed.float(), scale)
    with pytest.raises(mxfp4.MXFP4Error, match="takes 32"):
        mxfp4.matmul(torch.ones(3, 30), packed, scale)
    with pytest.raises(mxfp4.MXFP4Error, match="unknown backend"):
        mxfp4.matmul(torch.ones(3, 32), packed, scale, backend="cuda")


def test_dequantize_matches_a_hand_written_decoder_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)  # every byte
    scale = torch.tensor([0, 1, 2, 100, 125, 126, 127, 128, 129, 200, 250, 252, 253, 254, 255, 255], dtype=torch.uint8)
    packed = torch.cat([packed, torch.randint(0, 256, (4, 64), generator=g, dtype=torch.uint8)])
    scale = torch.cat([scale.reshape(4, 4), torch.randint(0, 256, (4, 4), generator=g, dtype=torch.uint8)])
    reference = _decode_by_hand(packed, scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _same_bits(mxfp4.dequantize(packed, scale, dtype), reference.to(dtype)), dtype


def test_dequantize_matches_compressed_tensors():
    unpack = importlib.import_module("compressed_tensors.compressors.nvfp4.helpers").unpack_fp4_from_uint8
    decompress_scale = importlib.import_module("compressed_tensors.compressors.mx_utils").decompress_mx_scale
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 255, (16, 4), generator=g, dtype=torch.uint8)  # 255 (NaN) decodes as inf there
    codes = unpack(packed, 16, 128)  # bf16 E2M1 values
    theirs = (codes.reshape(16, 4, 32) * decompress_scale(scale)[..., None]).reshape(16, 128)
    assert _same_bits(mxfp4.dequantize(packed, scale, torch.bfloat16), theirs)


def test_quantize_codes_match_compressed_tensors_for_the_same_scales():
    helpers = importlib.import_module("compressed_tensors.compressors.nvfp4.helpers")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=g, dtype=torch.bfloat16) * torch.logspace(-3, 3, 32)[:, None].bfloat16()
    w[0, :16] = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -1.25, -2.5, -3.5, -5.0, -0.1, 4]
    )
    packed, scale = mxfp4.quantize(w)
    # Their rounding given our (OCP) scales; the scale choice itself differs by design: they round
    # amax to a power of two before taking the exponent. (Exact -0.0 inputs are left out: their
    # CPU path turns them into +0 through torch.sign.)
    theirs = helpers.quantize_and_pack_fp4(w, mxfp4._scale_values(scale), group_size=32)
    assert torch.equal(packed, theirs)


def test_round_trip_error_bound_and_idempotence():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 256, generator=g) * torch.logspace(-8, 8, 64)[:, None]).bfloat16()
    packed, scale = mxfp4.quantize(w)
    back = mxfp4.dequantize(packed, scale, torch.float32)
    step = mxfp4._scale_values(scale).repeat_interleave(32, dim=1)
    assert bool(((back - w.float()).abs() <= 2 * step).all())  # <= half the widest gap (4 -> 6), or 6 -> 8 saturation
    again = mxfp4.quantize(mxfp4.dequantize(packed, scale))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96)])
def test_torch_matmul_equals_dequantise_then_matmul(shape, monkeypatch):
    g = torch.Generator().manual_seed(5)
    packed, scale = mxfp4.quantize(torch.randn(80, 96, generator=g))
    x = torch.randn(*shape, generator=g).bfloat16()
    monkeypatch.setattr(mxfp4, "_TORCH_CHUNK_BYTES", 4 * 96 * 24)  # several row chunks, one ragged
    y = mxfp4.matmul(x, packed, scale, backend="torch")
    reference = x.float() @ mxfp4.dequantize(packed, scale).float().T
    assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 80)
    torch.testing.assert_close(y.float(), reference, rtol=2**-8, atol=1e-5)


def test_torch_expert_matmul_by_expert_ranges():
    g = torch.Generator().manual_seed(6)
    weights = [mxfp4.quantize(torch.randn(48, 64, generator=g)) for _ in range(3)]
    packed = torch.stack([p for p, _ in weights])
    scale = torch.stack([s for _, s in weights])
    x = torch.randn(5, 64, generator=g).bfloat16()
    y = mxfp4.expert_matmul(x, torch.tensor([0, 2, 2, 5]), packed, scale, backend="torch")
    for e, rows in ((0, slice(0, 2)), (2, slice(2, 5))):
        torch.testing.assert_close(y[rows], mxfp4.matmul(x[rows], *weights[e], backend="torch"), rtol=0, atol=0)
    with pytest.raises(mxfp4.MXFP4Error, match="rise from 0 to 5"):
        mxfp4.expert_matmul(x, torch.tensor([0, 3, 2, 5]), packed, scale, backend="torch")


def test_k3_config_parses_under_the_compressed_tensors_schema():
    ct = importlib.import_module("compressed_tensors.quantization")
    config = ct.QuantizationConfig.model_validate(mxfp4.K3_QUANTIZATION_CONFIG)
    assert config.format == "mxfp4-pack-quantized"
    weights = config.config_groups["group_0"].weights
    assert (weights.num_bits, weights.type, weights.group_size, weights.scale_dtype) == (4, "float", 32, torch.uint8)


def test_swap_packs_exactly_the_routed_experts():
    tree = k3_like_tree()
    swapped = mxfp4.apply_quantization_config(tree, mxfp4.K3_QUANTIZATION_CONFIG)
    assert swapped == routed_expert_names()
    for name, module in tree.named_modules():
        if isinstance(module, mxfp4.MXFP4Linear):
            assert name in swapped
        elif isinstance(module, nn.Linear):
            assert module.weight.dtype == torch.bfloat16, name
    experts = tree.language_model.model.layers[1].block_sparse_moe.experts[0]
    assert isinstance(experts.w1, mxfp4.MXFP4Linear) and experts.w1.weight_packed.shape == (64, 16)


def test_swap_agrees_with_compressed_tensors_matching():
    match = importlib.import_module("compressed_tensors.utils.match")
    config = mxfp4.K3_QUANTIZATION_CONFIG
    tree = k3_like_tree(device="meta")
    targets, ignore = config["config_groups"]["group_0"]["targets"], config["ignore"]
    theirs = sorted(
        "wrapped." + n for n, m in tree.named_modules() if match.is_match("wrapped." + n, m, targets, ignore)
    )
    assert mxfp4.apply_quantization_config(tree, config, prefix="wrapped.") == theirs
    assert len(theirs) == 24


def test_swap_follows_the_config_not_the_names():
    config = {**mxfp4.K3_QUANTIZATION_CONFIG, "ignore": [r"re:.*\.experts\.", "re:vision_tower.*", "lm_head"]}
    tree = k3_like_tree(device="meta").language_model
    swapped = mxfp4.apply_quantization_config(tree, config, prefix="language_model")
    assert "language_model.model.layers.0.self_attn.q_proj" in swapped
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj" in swapped
    # The ignore regexes see the full name: `lm_head` alone does not match `language_model.lm_head`.
    assert "language_model.lm_head" in swapped
    assert not any(".experts." in n for n in swapped)


def test_swap_on_meta_creates_no_real_memory():
    tree = k3_like_tree(device="meta")
    mxfp4.apply_quantization_config(tree, mxfp4.K3_QUANTIZATION_CONFIG)
    layer = tree.language_model.model.layers[2].block_sparse_moe.experts[3].w2
    assert layer.weight_packed.is_meta and layer.weight_packed.dtype == torch.uint8
    assert layer.weight_scale.shape == (32, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "gptq"}, "quant_method"),
        ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
        ({"ignore": ["re:("]}, "invalid regex"),
        ({"config_groups": {}}, "no config_groups"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    config = {**mxfp4.K3_QUANTIZATION_CONFIG, **change}
    if "format" in change:
        config["config_groups"] = {"g": {**config["config_groups"]["group_0"], "format": None}}
    with pytest.raises(mxfp4.MXFP4Error, match=message):
        mxfp4.apply_quantization_config(k3_like_tree(device="meta"), config)


@pytest.mark.parametrize(
    ("weights_change", "message"),
    [({"group_size": 16}, "group_size"), ({"num_bits": 8}, "num_bits"), ({"symmetric": False}, "symmetric")],
)
def test_non_mxfp4_weight_args_are_rejected(weights_change, message):
    group = mxfp4.K3_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    config = {
        **mxfp4.K3_QUANTIZATION_CONFIG,
        "config_groups": {"g": {**group, "weights": {**group["weights"], **weights_change}}},
    }
    with pytest.raises(mxfp4.MXFP4Error, match=message):
        mxfp4.apply_quantization_config(nn.Linear(32, 32), config)


def test_activation_quantisation_is_rejected():
    group = mxfp4.K3_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    config = {**mxfp4.K3_QUANTIZATION_CONFIG, "config_groups": {"g": {**group, "input_activations": {"num_bits": 8}}}}
    with pytest.raises(mxfp4.MXFP4Error, match="weight-only"):
        mxfp4.apply_quantization_config(nn.Linear(32, 32), config)


def test_targeted_layer_with_bad_width_is_named():
    tree = nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(48, 32)])})
    with pytest.raises(mxfp4.MXFP4Error, match=r"experts\.0 .*in_features 48"):
        mxfp4.apply_quantization_config(tree, mxfp4.K3_QUANTIZATION_CONFIG)


def test_swapped_real_module_computes_the_quantised_product():
    g = torch.Generator().manual_seed(7)
    tree = k3_like_tree()
    for p in tree.parameters():
        p.data = torch.randn(p.shape, generator=g).bfloat16()
    expert = tree.language_model.model.layers[1].block_sparse_moe.experts[2]
    w3 = expert.w3.weight.detach().clone()
    mxfp4.apply_quantization_config(tree, mxfp4.K3_QUANTIZATION_CONFIG)
    x = torch.randn(3, 32, generator=g).bfloat16()
    reference = x.float() @ mxfp4.dequantize(*mxfp4.quantize(w3)).float().T
    torch.testing.assert_close(expert.w3(x).float(), reference, rtol=2**-8, atol=1e-5)


def test_quantize_tensors_replaces_targeted_weights():
    g = torch.Generator().manual_seed(8)
    tree = k3_like_tree()
    tensors = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in tree.state_dict().items()}
    linear = [n for n, m in tree.named_modules() if isinstance(m, nn.Linear)]
    out = mxfp4.quantize_tensors(tensors, mxfp4.K3_QUANTIZATION_CONFIG, linear_modules=linear)
    experts = routed_expert_names()
    assert set(out) == (set(tensors) - {f"{n}.weight" for n in experts}) | {
        f"{n}.{s}" for n in experts for s in ("weight_packed", "weight_scale")
    }
    name = experts[0]
    packed, scale = mxfp4.quantize(tensors[f"{name}.weight"])
    assert torch.equal(out[f"{name}.weight_packed"], packed) and torch.equal(out[f"{name}.weight_scale"], scale)
    assert out["language_model.model.embed_tokens.weight"] is tensors["language_model.model.embed_tokens.weight"]


def test_quantize_tensors_takes_linear_layers_from_the_caller():
    # A `Linear` target cannot be checked on bare tensors: only the named linear modules count,
    # so a 2-D router or embedding weight is never packed by accident.
    config = {**mxfp4.K3_QUANTIZATION_CONFIG, "ignore": []}
    tensors = {"a.weight": torch.ones(32, 32), "gate.weight": torch.ones(8, 32), "norm.weight": torch.ones(32)}
    assert set(mxfp4.quantize_tensors(tensors, config, linear_modules=["a"])) == {
        "a.weight_packed", "a.weight_scale", "gate.weight", "norm.weight"
    }  # fmt: skip
    by_name = {**config, "config_groups": {"g": {**config["config_groups"]["group_0"], "targets": ["re:.*gate$"]}}}
    assert set(mxfp4.quantize_tensors(tensors, by_name, linear_modules=[])) == {
        "a.weight", "gate.weight_packed", "gate.weight_scale", "norm.weight"
    }  # fmt: skip


def test_cpu_use_imports_neither_triton_nor_compressed_tensors():
    code = (
        "import sys, torch\n"
        "from textcore import mxfp4\n"
        "p, s = mxfp4.quantize(torch.randn(32, 64))\n"
        "mxfp4.matmul(torch.randn(2, 64), p, s)\n"
        "mxfp4.apply_quantization_config(torch.nn.Sequential(torch.nn.Linear(64, 32)), mxfp4.K3_QUANTIZATION_CONFIG)\n"
        "heavy = ('triton', 'textcore.mxfp4_triton', 'compressed_tensors', 'transformers')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)
