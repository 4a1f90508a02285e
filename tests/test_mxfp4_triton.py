"""Triton MXFP4 kernels, run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest).

Shapes are tiny and blocks large so the interpreter stays fast; ragged edges in M, N and K are
all exercised. The GPU performance run lives in bench/gpu_mxfp4.py.
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

from textcore import mxfp4

assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must set TRITON_INTERPRET before kernels are imported"
from textcore import mxfp4_triton as triton_kernels  # noqa: E402  (after the TRITON_INTERPRET check)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return mxfp4.quantize(torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None])


def _reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantise, then matmul in float32."""
    return x.float() @ mxfp4.dequantize(packed, scale, torch.float32).T


@pytest.mark.parametrize(
    ("m", "n", "k", "blocks"),
    [
        (1, 40, 64, None),  # decode-sized: default blocks, BLOCK_K larger than K
        (5, 48, 96, (16, 32, 64)),  # ragged K tail (96 = 64 + 32) and ragged M
        (20, 33, 128, (32, 16, 128)),  # ragged N, two M tiles
    ],
)
def test_dense_kernel_equals_dequantise_then_matmul(m, n, k, blocks):
    packed, scale = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = triton_kernels.mxfp4_matmul(x, packed, scale, blocks=blocks)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), _reference(x, packed, scale), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(y, mxfp4.matmul(x, packed, scale, backend="torch"), rtol=2**-7, atol=1e-6)


def test_dense_kernel_decodes_every_byte_and_scale_exactly():
    # x = identity in float32 makes the kernel return W itself: every byte value, scale codes from 0
    # (subnormal 2^-127) to 252 (the largest without overflow, which would turn 0 * inf into NaN).
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    scale = torch.tensor([[0, 1], [2, 60], [100, 126], [127, 128], [129, 180], [200, 250], [251, 252], [3, 127]])
    scale = scale.to(torch.uint8)
    w = triton_kernels.mxfp4_matmul(torch.eye(64), packed, scale, blocks=(64, 16, 64)).T
    expected = mxfp4.dequantize(packed, scale, torch.float32)
    assert torch.equal(w, expected)  # (+0 and -0 compare equal: the dot's sums lose the sign of zero)


def test_nan_scale_gives_nan():
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)
    scale = torch.tensor([[255], [127]], dtype=torch.uint8)
    y = triton_kernels.mxfp4_matmul(torch.ones(1, 32, dtype=torch.bfloat16), packed, scale)
    assert torch.isnan(y[0, 0]) and y[0, 1].item() == 32.0


def test_matmul_dispatch_with_batch_dims_and_strided_x():
    packed, scale = _weight(32, 64, seed=9)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1)).bfloat16().T  # non-contiguous
    y = mxfp4.matmul(x.reshape(2, 3, 64), packed, scale, backend="triton")
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y.reshape(6, 32).float(), _reference(x, packed, scale), rtol=2**-8, atol=1e-6)


def test_expert_kernel_equals_per_expert_reference():
    num_experts, n, k = 4, 40, 64
    weights = [_weight(n, k, seed=10 + e) for e in range(num_experts)]
    packed = torch.stack([p for p, _ in weights])
    scale = torch.stack([s for _, s in weights])
    counts = [0, 18, 0, 3]  # empty experts first and in the middle; 18 rows need two 16-row tiles
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = triton_kernels.mxfp4_expert_matmul(x, offsets, packed, scale, blocks=(16, 32, 64))
    for e in range(num_experts):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        torch.testing.assert_close(y[rows].float(), _reference(x[rows], *weights[e]), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(y, mxfp4.expert_matmul(x, offsets, packed, scale, backend="torch"), rtol=2**-7, atol=0)
    torch.testing.assert_close(y, mxfp4.expert_matmul(x, offsets, packed, scale, backend="triton"), rtol=0, atol=0)


def test_empty_inputs_and_bad_arguments():
    packed, scale = _weight(32, 64, seed=3)
    assert triton_kernels.mxfp4_matmul(torch.empty(0, 64, dtype=torch.bfloat16), packed, scale).shape == (0, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        triton_kernels.mxfp4_matmul(torch.ones(2, 32), packed, scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_kernels.mxfp4_matmul(torch.ones(2, 64), packed, scale, blocks=(16, 16, 48))
    with pytest.raises(ValueError, match=r"expert_offsets \[E\+1\]"):
        triton_kernels.mxfp4_expert_matmul(torch.ones(2, 64), torch.tensor([0]), packed[None], scale[None])


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from textcore import mxfp4_triton as k

pointers = {"x_ptr": "*bf16", "offsets_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*bf16"}
consts = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "DOT_FP32": False}
for kernel in (k._mxfp4_matmul_kernel, k._mxfp4_expert_kernel):
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32))
    assert "mma.sync" in compiled.asm["ptx"] and compiled.asm["cubin"]
"""


def test_gpu_path_compiles_for_hopper(tmp_path):
    """The GPU code path (bf16 tensor-core dots, bf16 stores) never runs in the interpreter: compile
    the dense kernel (the one MXFP4Linear uses) and the grouped expert kernel (the MoE's on CUDA)
    ahead of time for sm_90 (H100/H200) with Triton's bundled ptxas, no GPU needed. One config
    each, to keep the test short; bench/gpu_mxfp4.py compiles the rest on a real GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], cwd=REPO_ROOT, env=env, check=True, timeout=300)


def _packed_moe(seed: int):
    """Layer 1's Latent MoE of the tiny trunk (8 experts, top-2, latent 32 -> 32) with its routed
    experts' w1/w2/w3 packed as MXFP4, as a quantised checkpoint loads them, and grouped."""
    from textcore.config import tiny
    from textcore.model import KimiLinearForCausalLM

    moe = KimiLinearForCausalLM.random(tiny(), seed=seed).model.layers[1].block_sparse_moe
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            setattr(expert, name, mxfp4.MXFP4Linear.from_linear(getattr(expert, name)))
    assert moe.group_experts()
    return moe


def test_grouped_moe_equals_the_per_expert_loop(torch_one_thread):
    """The routed experts as two grouped Triton launches (w1 with w3, then w2) give what the
    per-expert loop gives (the CPU / reference path), with experts that get no token, one token,
    and many."""
    moe = _packed_moe(seed=5)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(6))
    x = torch.cat([x, x[:1].expand(20, 64)])  # 20 copies of one token: its two experts get many rows
    ids, weights = moe.gate(x)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    assert counts.max() >= 21 and (counts <= 1).any(), counts.tolist()
    z = moe.routed_expert_down_proj(x)
    moe.expert_backend = "loop"
    loop = moe.routed(z, ids, weights)
    want = moe(x)
    moe.expert_backend = "grouped"
    grouped = moe.routed(z, ids, weights)
    assert grouped.dtype == torch.float32 and grouped.shape == (57, 32)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
    moe.expert_backend = "auto"  # on the CPU: the loop
    assert torch.equal(moe(x), want)


def test_grouped_experts_hold_their_weights_once():
    moe = _packed_moe(seed=7)
    gate_up_packed, gate_up_scale, down_packed, _ = moe._grouped
    assert (gate_up_packed.shape, gate_up_scale.shape, down_packed.shape) == ((8, 64, 16), (8, 64, 1), (8, 32, 16))
    w1, w3, w2 = moe.experts[5].w1, moe.experts[5].w3, moe.experts[5].w2
    # Each expert's buffers are views of the stacks (one copy of the weights), under their checkpoint names.
    assert w1.weight_packed.data_ptr() == gate_up_packed[5].data_ptr()
    assert w3.weight_packed.data_ptr() == gate_up_packed[5, 32:].data_ptr()
    assert w2.weight_scale.data_ptr() == moe._grouped[3][5].data_ptr()
    assert {"experts.5.w1.weight_packed", "experts.5.w3.weight_scale", "experts.5.w2.weight_packed"} <= set(
        moe.state_dict())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8))
    moe.expert_backend = "grouped"
    before = moe(x)
    # A move replaces every tensor by a copy (what .to(device) does): the experts are stacked again.
    moe._apply(torch.clone)
    assert moe.experts[5].w1.weight_packed.data_ptr() == moe._grouped[0][5].data_ptr() != gate_up_packed[5].data_ptr()
    assert torch.equal(moe(x), before)
    from textcore.config import tiny
    from textcore.model import KimiLinearForCausalLM

    dense = KimiLinearForCausalLM.random(tiny(), seed=7).model.layers[1].block_sparse_moe
    assert not dense.group_experts()  # dense experts: nothing to stack, they take the loop
    dense.expert_backend = "grouped"
    with pytest.raises(ValueError, match="needs MXFP4 experts"):
        dense(x)
