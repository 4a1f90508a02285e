"""Kimi Delta Attention (KDA): the two reference recurrences and the KDA layer.

Layout follows fla (`fla/ops/kda`): q, k, g are `[B, T, H, K]`, v is `[B, T, H, V]`, beta is
`[B, T, H]`, the state is `[B, H, K, V]`. Per head and step (g is a per-key-channel log decay):

    S = S * exp(g)[:, None]
    S = S + (beta k) (v - k^T S)^T
    o = (scale q)^T S

`recurrent_kda` runs that loop token by token (decode, and the ground truth). `chunk_kda` computes
the same thing in chunks of CHUNK tokens with the WY representation: inside a chunk the delta-rule
corrections are one unit-lower-triangular solve, so the sequential part is one small matmul chain
per chunk instead of per token. Both take q/k/v/g/beta as given; L2-normalising q/k, making the
gate and the sigmoid beta are the layer's job (`KimiDeltaAttention` below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64  # tokens per chunk in chunk_kda
SUB_CHUNK = 32  # rows sharing one reference point when in-chunk decays are factorised
SLAB = 8  # chunks whose S-independent parts are computed together (bounds the memory)
LOG_DECAY_MIN = -5.0  # chunk_kda accepts g in [LOG_DECAY_MIN, 0]; the K3 gate is bounded at -5
A_LOG_ALIGN = 128  # published A_log: [ceil(heads / 128) * 128], zero beyond the heads (SGLang, NeMo ports)
L2_EPS = 1e-6  # q, k L2 norm: x / sqrt(sum x^2 + eps), as the reference kernel does


def _check_shapes(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share one [B, T, H, K] shape; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(g.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(beta.shape)}")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}]; "
                         f"got {tuple(initial_state.shape)}")
    return B, T, H, K, V


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA in fp32. Returns (o `[B, T, H, V]` in v's dtype, final state or None)."""
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = v.new_empty(B, T, H, V)
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp().unsqueeze(-1)
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o.to(v.dtype), (S if output_final_state else None)


def _decayed_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For x in (q, k): P[t, j] = sum_d x[t, d] k[j, d] exp(G[t, d] - G[j, d]) for j <= t, else 0.

    q, k, G: `[..., C, K]`, G the in-chunk cumulative log decay. exp(G_t - G_j) is factorised as
    exp(G_t - m) exp(m - G_j) around m, the cumulative decay at the middle row of t's SUB_CHUNK
    block, so one batched matmul gives every entry. With every g in [LOG_DECAY_MIN, 0] each factor
    of a kept entry stays within exp(+-SUB_CHUNK/2 * |LOG_DECAY_MIN|) = exp(+-80), finite in fp32;
    a factor that underflows belongs to an entry below exp(-20), which is negligible.
    """
    *lead, C, K = q.shape
    n, s = C // SUB_CHUNK, SUB_CHUNK
    Gb = G.reshape(*lead, n, s, K)
    mid = Gb[..., s // 2: s // 2 + 1, :]  # [..., n, 1, K]
    rows = torch.stack([q, k]).reshape(2, *lead, n, s, K) * (Gb - mid).exp()
    # columns after t's block are masked below; the clamp only keeps them finite
    cols = k.unsqueeze(-3) * (mid - G.unsqueeze(-3)).clamp(max=-LOG_DECAY_MIN * s / 2).exp()  # [..., n, C, K]
    P = (rows @ cols.transpose(-1, -2)).reshape(2, *lead, C, C).tril()
    return P[0], P[1]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY-form) KDA in fp32, any T; same contract and result as `recurrent_kda`.

    g must be a log decay in [LOG_DECAY_MIN, 0] (the layer's `-5 * sigmoid(...)` gate always is);
    anything else is refused rather than risking fp32 overflow in the factorised decays.
    T is padded to a multiple of CHUNK with k = v = beta = g = 0, which leaves the state untouched.
    Per chunk with cumulative decay G (within the chunk) and chunk-start state S0:
        (I + A) [U | W] = diag(beta) [V | K*exp(G)],  A[t, j] = beta_t k_t.(exp(G_t - G_j) k_j), j < t
        delta = U - W S0
        o = (Q*exp(G)) S0 + M delta,                 M[t, j] = q_t.(exp(G_t - G_j) k_j), j <= t
        S = exp(G_C) * S0 + (K*exp(G_C - G))^T delta
    Everything that does not involve S0 is computed for SLAB chunks at once; only the three lines
    with S0 run chunk by chunk.
    """
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    if g.numel() and (float(g.min()) < LOG_DECAY_MIN or float(g.max()) > 0):
        raise ValueError(f"chunk_kda needs g (log decay) in [{LOG_DECAY_MIN}, 0]; got "
                         f"{float(g.min()):.3g}..{float(g.max()):.3g} (use recurrent_kda)")
    out_dtype = v.dtype
    pad = (-T) % CHUNK
    N = (T + pad) // CHUNK

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> fp32 [B, H, N, CHUNK, ...]
        t = t.float().transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.reshape(B, H, N, CHUNK, *t.shape[3:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    q = q * scale
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    eye = torch.eye(CHUNK, device=q.device)
    o = torch.empty_like(v)
    for first in range(0, N, SLAB):
        sl = slice(first, first + SLAB)
        q_s, k_s, v_s, b_s = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl, :, None]
        G = g[:, :, sl].cumsum(-2)
        M, Akk = _decayed_products(q_s, k_s, G)
        A = Akk.tril(-1) * b_s
        rhs = b_s * torch.cat([v_s, k_s * G.exp()], dim=-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        U = UW[..., :V]
        # rows [W ; Q*exp(G)] share the product with S0
        WQ = torch.cat([UW[..., V:], q_s * G.exp()], dim=-2)
        G_end = G[..., -1:, :]
        k_to_end = (k_s * (G_end - G).exp()).transpose(-1, -2)  # [B, H, n, K, CHUNK]
        decay_all = G_end.transpose(-1, -2).exp()  # [B, H, n, K, 1]
        for i in range(U.shape[2]):
            X = WQ[:, :, i] @ S
            delta = U[:, :, i] - X[..., :CHUNK, :]
            o[:, :, first + i] = X[..., CHUNK:, :] + M[:, :, i] @ delta
            S = decay_all[:, :, i] * S + k_to_end[:, :, i] @ delta
    o = o.reshape(B, H, N * CHUNK, V)[:, :, :T].transpose(1, 2).to(out_dtype)
    return o, (S if output_final_state else None)


class Linear(nn.Linear):
    """A bias-free nn.Linear created uninitialised: every trunk weight is loaded (checkpoint or
    `random_weights`), and initialising the K3's quarter-million expert layers, even on the meta
    device, would cost seconds for nothing."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def reset_parameters(self) -> None:
        pass


def linear(in_features: int, out_features: int, dtype: torch.dtype | None = None) -> nn.Linear:
    return Linear(in_features, out_features, dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference does it: normalise in fp32, cast back, then scale; x's dtype out."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ShortConv(nn.Module):
    """Depthwise causal conv (no bias, fp32 weight `[C, 1, kernel]` as in nn.Conv1d), then SiLU."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=torch.float32))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, C]`; state: the previous kernel-1 inputs `[B, C, kernel-1]` (zeros at the start).
        Returns (SiLU(conv(x)) in fp32 `[B, T, C]`, the new state)."""
        B, T, C = x.shape
        xt = x.float().transpose(1, 2)
        if state is None:
            state = xt.new_zeros(B, C, self.kernel - 1)
        full = torch.cat([state, xt], dim=-1)
        y = F.conv1d(full, self.weight, groups=C)
        return F.silu(y).transpose(1, 2), full[..., full.shape[-1] - (self.kernel - 1):]


class KDACache:
    """Decode state of one KDA layer: conv inputs and the recurrent state, both fp32."""

    def __init__(self):
        self.conv: list[torch.Tensor | None] = [None, None, None]  # q, k, v
        self.state: torch.Tensor | None = None


class KimiDeltaAttention(nn.Module):
    """One KDA layer (tensor names as in the published checkpoint's `self_attn.*`)."""

    def __init__(self, cfg, dtype: torch.dtype | None = None):
        super().__init__()
        H, D, hidden = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        proj = H * D
        self.num_heads, self.head_dim = H, D
        self.gate_lower_bound = cfg.gate_lower_bound
        self.norm_eps = cfg.rms_norm_eps

        def lin(i, o):
            return linear(i, o, dtype)

        self.q_proj, self.k_proj, self.v_proj = lin(hidden, proj), lin(hidden, proj), lin(hidden, proj)
        self.q_conv1d = ShortConv(proj, cfg.short_conv_kernel_size)
        self.k_conv1d = ShortConv(proj, cfg.short_conv_kernel_size)
        self.v_conv1d = ShortConv(proj, cfg.short_conv_kernel_size)
        self.f_a_proj, self.f_b_proj = lin(hidden, D), lin(D, proj)
        # per-head decay rate; the checkpoint stores it zero-padded to a multiple of A_LOG_ALIGN
        self.A_log = nn.Parameter(torch.zeros(-(-H // A_LOG_ALIGN) * A_LOG_ALIGN, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(proj, dtype=torch.float32))
        self.b_proj = lin(hidden, H)
        self.g_proj = lin(hidden, proj)  # full-rank output gate
        self.o_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=torch.float32)  # shipped in fp32
        self.o_proj = lin(proj, hidden)

    def forward(self, x: torch.Tensor, cache: KDACache | None = None,
                pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, T, hidden]`; pad_mask `[B, T]` True at left-padding positions, which then leave
        conv and recurrent state exactly as if they were absent."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        if pad_mask is not None:
            qkv = [t.masked_fill(pad_mask[..., None], 0) for t in qkv]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        outs = []
        for i, (t, conv) in enumerate(zip(qkv, convs, strict=True)):
            y, new_state = conv(t, cache.conv[i] if cache is not None else None)
            if cache is not None:
                cache.conv[i] = new_state
            outs.append(y.view(B, T, H, D))
        q, k, v = l2_normalize(outs[0]), l2_normalize(outs[1]), outs[2]
        raw = self.f_b_proj(self.f_a_proj(x)).float().view(B, T, H, D)
        rate = self.A_log[:H].float().exp()[:, None]  # [H, 1]
        g = self.gate_lower_bound * torch.sigmoid(rate * (raw + self.dt_bias.view(H, D)))  # in [bound, 0)
        beta = torch.sigmoid(self.b_proj(x).float())
        if pad_mask is not None:
            g = g.masked_fill(pad_mask[..., None, None], 0)
            beta = beta.masked_fill(pad_mask[..., None], 0)
        state = cache.state if cache is not None else None
        kda = recurrent_kda if T == 1 else chunk_kda
        o, state = kda(q, k, v, g, beta, scale=D**-0.5, initial_state=state, output_final_state=cache is not None)
        if cache is not None:
            cache.state = state
        gate = torch.sigmoid(self.g_proj(x).float()).view(B, T, H, D)
        o = rms_norm(o, self.o_norm.weight, self.norm_eps) * gate
        return self.o_proj(o.reshape(B, T, H * D).to(x.dtype))
