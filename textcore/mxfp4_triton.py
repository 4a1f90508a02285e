"""Triton kernels for weight-only MXFP4 GEMMs (bf16 activations, float32 accumulation).

The weight is decoded tile by tile inside the kernel from its packed bytes and E8M0 scales;
no dense copy of W ever exists. Each byte holds columns 2j (low nibble) and 2j+1 (high
nibble), so a K-tile is computed as `x[:, even] @ W_lo.T + x[:, odd] @ W_hi.T`, which needs no
interleaving of the decoded nibbles.

Decoded values `E2M1 * 2^k` are exact in bf16, so on a GPU both dot operands are bf16 (tensor
cores, exact products, float32 accumulation); float32 activations get a float32 dot instead.
Triton's CPU interpreter computes a bf16 `tl.dot` wrongly, so there both operands are cast to
float32 first (same result, different speed), and its float32 -> bf16 cast truncates instead of
rounding to nearest even, so there the kernel stores float32 and torch does the final cast.

Block sizes are fixed per call by a small heuristic (no autotuning); callers may pass their own.
Import this module only where a kernel will run: `textcore.mxfp4` does it lazily.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP_SIZE = 32
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _decode(nibble, scale_code):
    """E2M1 nibbles and E8M0 scale codes (int32 tensors of one shape) -> float32 weights."""
    mag = nibble & 7
    exp_field = mag >> 1
    # E2M1 magnitude as float32 bits: 0 -> 0, 0.5 -> 2^-1, else 2^(e-1) * (1 + m/2).
    bits = tl.where(mag == 1, 126 << 23, ((exp_field + 126) << 23) | ((mag & 1) << 22))
    bits = tl.where(mag == 0, 0, bits)
    bits = bits | ((nibble & 8) << 28)  # sign bit
    # E8M0: 2^(s-127) from the bits; code 0 is the subnormal 2^-127, code 255 is NaN.
    sbits = tl.where(scale_code == 0, 0x00400000, scale_code << 23)
    sbits = tl.where(scale_code == 255, 0x7FC00000, sbits)
    return bits.to(tl.float32, bitcast=True) * sbits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_dot(
    acc,
    x_ptr,
    w_ptr,
    s_ptr,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """acc[BM, BN] += x[offs_m, :K] @ W[offs_n, :K].T with W decoded from packed bytes and scales."""
    offs_b = tl.arange(0, BLOCK_K // 2)  # byte column within a K tile
    for k0 in range(0, K, BLOCK_K):
        byte_col = k0 // 2 + offs_b
        k_mask = byte_col < K // 2
        w_mask = n_mask[:, None] & k_mask[None, :]
        w_bytes = tl.load(w_ptr + offs_n[:, None] * stride_wn + byte_col[None, :] * stride_wk, mask=w_mask, other=0)
        group = (k0 + 2 * offs_b) // 32
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + group[None, :] * stride_sk, mask=w_mask, other=127)
        w_bytes = w_bytes.to(tl.int32)
        s = s.to(tl.int32)
        w_lo = _decode(w_bytes & 15, s)
        w_hi = _decode(w_bytes >> 4, s)
        x_mask = m_mask[:, None] & k_mask[None, :]
        col = k0 + 2 * offs_b
        x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + (col + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
        if DOT_FP32:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_even.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)))
            acc += tl.dot(x_odd.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)))
    return acc


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _tile_dot(
        acc, x_ptr, w_ptr, s_ptr, offs_m, m_mask, offs_n, n_mask, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, BLOCK_K, DOT_FP32,
    )  # fmt: skip
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _mxfp4_expert_kernel(
    x_ptr,
    offsets_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One program per (expert, N tile): walks the expert's token rows BLOCK_M at a time."""
    expert = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    s_expert = s_ptr + expert.to(tl.int64) * stride_se
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tile_dot(
            acc, x_ptr, w_expert, s_expert, offs_m, m_mask, offs_n, n_mask, K,
            stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, BLOCK_K, DOT_FP32,
        )  # fmt: skip
        y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(M: int, N: int, K: int, blocks: tuple[int, int, int] | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Decode-sized batches are weight-bandwidth bound: narrow N tiles
    give more programs to stream the weight (N=3072 -> 192 programs for an H200's 132 SMs); larger
    batches get square-ish compute tiles. Chosen without a GPU run: see docs/BENCHMARKS.md."""
    if blocks is None:
        if M <= 16:
            blocks = (16, 16, 256)
        elif M <= 64:
            blocks = (64, 64, 128)
        else:
            blocks = (128, 128, 64)
    bm, bn, bk = blocks
    if bk % GROUP_SIZE or bk < GROUP_SIZE or min(bm, bn) < 16 or any(b & (b - 1) for b in blocks):
        raise ValueError(f"blocks {blocks}: all powers of two, BLOCK_M/N >= 16, BLOCK_K a multiple of {GROUP_SIZE}")
    return blocks


def _dot_in_fp32(x: torch.Tensor) -> bool:
    """float32 dot operands in the interpreter (see the module docstring) and for float32 x, whose
    precision a bf16 dot would silently drop; bf16 tensor-core dots otherwise."""
    return _INTERPRETER or x.dtype == torch.float32


def _store_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernel's output dtype: x's, except float32 in the interpreter (see the module docstring)."""
    return torch.float32 if _INTERPRETER else x.dtype


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    N, K = packed.shape[-2], packed.shape[-1] * 2
    if K % GROUP_SIZE or tuple(scale.shape[-2:]) != (N, K // GROUP_SIZE):
        raise ValueError(f"scale {list(scale.shape)} does not match packed {list(packed.shape)}")
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {list(x.shape)}")
    if x.device != packed.device or x.device != scale.device:
        raise ValueError(f"x, packed and scale must share a device, got {x.device}, {packed.device}, {scale.device}")
    return N, K


def mxfp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, blocks: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """`x [M, K] @ W.T` for MXFP4 `W [N, K]` given as packed `[N, K/2]` and scale `[N, K/32]`."""
    N, K = _check(x, packed, scale)
    M = x.shape[0]
    y = torch.empty(M, N, dtype=_store_dtype(x), device=x.device)
    if M == 0 or N == 0:
        return y.to(x.dtype)
    bm, bn, bk = _blocks(M, N, K, blocks)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _mxfp4_matmul_kernel[grid](
        x, packed, scale, y, M, N, K,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=_dot_in_fp32(x),
    )  # fmt: skip
    return y.to(x.dtype)


def mxfp4_expert_matmul(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Grouped expert GEMM: x `[T, K]` sorted by expert, expert_offsets `[E+1]` (row starts, last = T),
    packed `[E, N, K/2]`, scale `[E, N, K/32]` -> `[T, N]`. The offsets stay on the device (no sync);
    they must be non-decreasing from 0 to T, which the caller's sort guarantees."""
    N, K = _check(x, packed, scale)
    E = packed.shape[0]
    if packed.dim() != 3 or scale.dim() != 3 or scale.shape[0] != E or tuple(expert_offsets.shape) != (E + 1,):
        raise ValueError(
            f"expected packed [E, N, K/2], scale [E, N, K/32], expert_offsets [E+1]; got "
            f"{list(packed.shape)}, {list(scale.shape)}, {list(expert_offsets.shape)}"
        )
    T = x.shape[0]
    y = torch.empty(T, N, dtype=_store_dtype(x), device=x.device)
    if T == 0 or N == 0:
        return y.to(x.dtype)
    offsets = expert_offsets.to(device=x.device, dtype=torch.int32)
    # Tokens per expert are unknown on the host without a sync; size tiles by the average.
    bm, bn, bk = _blocks(max(1, T // max(1, E)), N, K, blocks)
    grid = (E, triton.cdiv(N, bn))
    _mxfp4_expert_kernel[grid](
        x, offsets, packed, scale, y, N, K,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), packed.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=_dot_in_fp32(x),
    )  # fmt: skip
    return y.to(x.dtype)
