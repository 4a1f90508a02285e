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

from textcore.segments import Segments

CHUNK = 32  # tokens per chunk in chunk_kda; its decays are factorised around the middle row, so
# CHUNK / 2 * |LOG_DECAY_MIN| = 80 must stay inside fp32's exp range (~88)
SLAB = 64  # (chunk, head) blocks whose S-independent parts are computed together: at least one chunk of
# all heads, otherwise bounded so that the slab's working set (~1 MB per tensor) stays in cache
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
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()  # never written: S is rebound
    o = v.new_empty(B, T, H, V)
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp().unsqueeze(-1)
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o.to(v.dtype), (S if output_final_state else None)


def _chunks(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens start:stop of x `[B, T, H, D]` (or `[B, T, H]`) as a new fp32 `[n * B * H, CHUNK, D]`,
    zero-padded to n whole chunks, chunk-major: chunk i of every head is one contiguous row range
    and each `[CHUNK, D]` block is contiguous, as batched matmuls want. Always a copy (the caller
    works on it in place)."""
    B, _, H = x.shape[:3]
    x = x[:, start:stop].reshape(B, stop - start, H, -1)
    n = (stop - start + CHUNK - 1) // CHUNK
    pad = n * CHUNK - (stop - start)
    x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x  # F.pad copies even when pad is 0
    out = torch.empty(n, B, H, CHUNK, x.shape[-1], device=x.device)
    return out.copy_(x.view(B, n, CHUNK, H, -1).permute(1, 0, 3, 2, 4)).view(n * B * H, CHUNK, -1)


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
    The last chunk is padded with k = v = beta = g = 0, which leaves the state untouched.
    Per chunk of CHUNK tokens with cumulative decay G (within the chunk) and chunk-start state S0:
        (I + A) [U | W] = diag(beta) [V | K*exp(G)],  A[t, j] = beta_t k_t.(exp(G_t - G_j) k_j), j < t
        delta = U - W S0
        o = (Q*exp(G)) S0 + M delta,                 M[t, j] = q_t.(exp(G_t - G_j) k_j), j <= t, Q = scale q
        S = exp(G_C) * S0 + (K*exp(G_C - G))^T delta
    Everything that does not involve S0 (A, M, Tb = (I + A)^-1 diag(beta), so that [U | W] =
    Tb [V | K*exp(G)]) is computed for a slab of chunks of all heads at once, as batched matmuls on
    contiguous [CHUNK, .] blocks. The chunk-by-chunk loop then does four matmuls per chunk:
        [X_K ; X_Q] = [K*exp(G) ; Q*exp(G)] S0,  delta = Tb (V - X_K),  o = X_Q + M delta,
        S = exp(G_C) * S0 + (K*exp(G_C - G))^T delta
    """
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    if g.numel():
        g_min, g_max = (float(x) for x in torch.aminmax(g))
        if not LOG_DECAY_MIN <= g_min <= g_max <= 0:  # also refuses NaN
            raise ValueError(f"chunk_kda needs g (log decay) in [{LOG_DECAY_MIN}, 0]; got {g_min:.3g}..{g_max:.3g} "
                             "(use recurrent_kda)")
    C, BH = CHUNK, B * H
    eye = torch.eye(C, device=q.device)
    S = q.new_zeros(BH, K, V, dtype=torch.float32) if initial_state is None else \
        initial_state.float().reshape(BH, K, V).clone()
    o = v.new_empty(B, T, H, V)
    slab_tokens = max(1, SLAB // BH) * C
    for start in range(0, T, slab_tokens):
        stop = min(start + slab_tokens, T)
        q_s, k_s, v_s, G, b_s = (_chunks(t, start, stop) for t in (q, k, v, g, beta))
        n = q_s.shape[0] // BH  # chunks in this slab
        for row in range(1, C):  # cumulative decay within each chunk (in place: faster than cumsum(-2))
            G[:, row] += G[:, row - 1]
        # exp(G_t - G_j) = exp(G_t - m) exp(m - G_j) with m = G at the middle row: with g in
        # [LOG_DECAY_MIN, 0] both factors stay within exp(+-CHUNK/2 * |LOG_DECAY_MIN|) = exp(+-80)
        mid = G[:, C // 2: C // 2 + 1]  # [n*BH, 1, K]
        E = (G - mid).exp_()  # exp(G_t - m)
        k_back = k_s / E  # k_j exp(m - G_j)
        # KQ = [K*exp(G - m) ; scale Q*exp(G - m)]: one matmul with k_back gives A and M; rescaled by
        # exp(m) below it is [K*exp(G) ; scale Q*exp(G)], whose one matmul with S0 the loop needs
        KQ = torch.empty(n * BH, 2 * C, K, device=q.device)
        torch.mul(k_s, E, out=KQ[:, :C])
        torch.mul(q_s.mul_(scale), E, out=KQ[:, C:])
        AM = torch.bmm(KQ, k_back.mT)  # entries above the diagonal may overflow; tril_ overwrites them
        A = AM[:, :C].tril_(-1).mul_(b_s)
        M = AM[:, C:].tril_()
        Tb = torch.linalg.solve_triangular(A.add_(eye), eye.expand_as(A), upper=False, unitriangular=True)
        Tb.mul_(b_s.mT)  # (I + A)^-1 diag(beta)
        KQ.view(n * BH, 2, C, K).mul_(mid.exp().unsqueeze(1))
        G_end = G[:, -1:]
        k_to_end = k_back.mul_((G_end - mid).exp_()).mT  # [n*BH, K, C]: (k_j exp(G_C - G_j))^T
        decay = G_end.exp().mT  # [n*BH, K, 1]
        o_s = torch.empty(n * BH, C, V, device=q.device)
        for i in range(0, n * BH, BH):
            heads = slice(i, i + BH)
            X = torch.bmm(KQ[heads], S)
            delta = torch.bmm(Tb[heads], v_s[heads] - X[:, :C])  # U - W S0 = Tb (V - K*exp(G) S0)
            torch.baddbmm(X[:, C:], M[heads], delta, out=o_s[heads])
            S.mul_(decay[heads]).baddbmm_(k_to_end[heads], delta)
        o[:, start:stop] = o_s.view(n, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, V)[:, :stop - start]
    return o, (S.view(B, H, K, V) if output_final_state else None)


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

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token of each of B sequences: x `[B, C]`, state `[B, C, kernel-1]` -> (SiLU(conv)
        in fp32 `[B, C]`, the new state). The conv of one output per channel written out: each
        channel's taps times its kernel, summed (F.conv1d's depthwise kernel costs ~100x more on
        CPU for this shape)."""
        full = torch.cat([state, x.float()[..., None]], dim=-1)
        return F.silu((full * self.weight[:, 0]).sum(-1)), full[..., 1:]


class KDACache:
    """Decode state of one sequence in one KDA layer: the conv inputs (q, k, v) and the recurrent
    state, fp32; None until the sequence's first token (the zero state)."""

    def __init__(self):
        self.conv: list[torch.Tensor | None] = [None, None, None]  # each [channels, kernel - 1]
        self.state: torch.Tensor | None = None  # [H, K, V]

    def clone(self) -> KDACache:
        copy = KDACache()
        copy.conv = [None if t is None else t.clone() for t in self.conv]
        copy.state = None if self.state is None else self.state.clone()
        return copy

    @staticmethod
    def nbytes(cfg) -> int:
        """What one sequence holds in one KDA layer (fp32)."""
        proj = cfg.kda_num_heads * cfg.kda_head_dim
        return 4 * (3 * proj * (cfg.short_conv_kernel_size - 1) + cfg.kda_num_heads * cfg.kda_head_dim ** 2)


def _stacked(states: list[torch.Tensor | None], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """`[B, *shape]` from per-sequence states (None: zeros, a sequence's first token)."""
    return torch.stack([s if s is not None else like.new_zeros(shape, dtype=torch.float32) for s in states])


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

    def forward(self, x: torch.Tensor, segments: Segments, caches: list[KDACache] | None = None) -> torch.Tensor:
        """x `[1, N, hidden]`: the new tokens of `segments`' sequences end to end, which continue
        `caches` (one per sequence) or, without caches, are whole sequences. The sequences of one
        token take one recurrent step on their stacked states; every other runs `chunk_kda` alone."""
        H, D = self.num_heads, self.head_dim
        N = x.shape[1]
        qkv = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        outs = []
        for i, (t, conv) in enumerate(zip(qkv, convs, strict=True)):
            y = t.new_empty(1, N, H * D, dtype=torch.float32)
            for b, y_b, state in self._conv_parts(t, conv, i, segments, caches):
                if b is None:  # the singles
                    y[0, segments.single_positions] = y_b[:, 0]
                else:
                    y[:, segments.span(b)] = y_b
                    if caches is not None:
                        caches[b].conv[i] = state[0].clone()  # not a view: that keeps the chunk's inputs
            outs.append(y.view(1, N, H, D))
        q, k, v = l2_normalize(outs[0]), l2_normalize(outs[1]), outs[2]
        raw = self.f_b_proj(self.f_a_proj(x)).float().view(1, N, H, D)
        rate = self.A_log[:H].float().exp()[:, None]  # [H, 1]
        g = self.gate_lower_bound * torch.sigmoid(rate * (raw + self.dt_bias.view(H, D)))  # in [bound, 0)
        beta = torch.sigmoid(self.b_proj(x).float())
        o = v.new_empty(1, N, H, D)
        if segments.singles:
            at = segments.single_positions
            mine = [caches[b] for b in segments.singles]
            state = _stacked([c.state for c in mine], (H, D, D), x)
            o_s, state = recurrent_kda(*(t[0, at][:, None] for t in (q, k, v, g, beta)), scale=D**-0.5,
                                       initial_state=state, output_final_state=True)
            o[0, at] = o_s[:, 0]
            for b, cache in enumerate(mine):
                cache.state = state[b]
        for b in segments.others:
            span = segments.span(b)
            state = caches[b].state[None] if caches is not None and caches[b].state is not None else None
            o_b, state = chunk_kda(*(t[:, span] for t in (q, k, v, g, beta)), scale=D**-0.5, initial_state=state,
                                   output_final_state=caches is not None)
            o[:, span] = o_b
            if caches is not None:
                caches[b].state = state[0]
        gate = torch.sigmoid(self.g_proj(x).float()).view(1, N, H, D)
        o = rms_norm(o, self.o_norm.weight, self.norm_eps) * gate
        return self.o_proj(o.reshape(1, N, H * D).to(x.dtype))

    @staticmethod
    def _conv_parts(t, conv, i, segments, caches):
        """The short conv of projection i, per part: (None, the singles' outputs `[Bd, 1, C]`, their
        new states, already stored) and (b, sequence b's outputs, its new state)."""
        if segments.singles:
            mine = [caches[b] for b in segments.singles]
            state = _stacked([c.conv[i] for c in mine], (t.shape[-1], conv.kernel - 1), t)
            y, new = conv.step(t[0, segments.single_positions], state)
            for b, cache in enumerate(mine):  # views of the step's [Bd, C, kernel] inputs: one column more, no copy
                cache.conv[i] = new[b]
            yield None, y[:, None], None
        for b in segments.others:
            state = caches[b].conv[i][None] if caches is not None and caches[b].conv[i] is not None else None
            y, new = conv(t[:, segments.span(b)], state)
            yield b, y, new
