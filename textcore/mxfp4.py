"""MXFP4 weights in the compressed-tensors `mxfp4-pack-quantized` layout (docs/MODEL.md §12).

A quantised linear layer `X` is stored as two uint8 tensors:
- `X.weight_packed` `[out, in/2]`: E2M1 codes, two per byte, the even column in the low nibble.
  Code bit 3 is the sign, bits 0-2 index E2M1_VALUES.
- `X.weight_scale` `[out, in/32]`: one E8M0 exponent per group of 32 columns of a row,
  `scale = 2^(code - 127)` (255 is NaN).
So `W[r, c] = E2M1_VALUES[code] * 2^(scale[r, c // 32] - 127)`: 4.25 bits per weight.

Which layers are quantised is decided only by the checkpoint's `quantization_config`
(compressed-tensors schema). The runtime path here imports neither compressed-tensors nor
Triton; the Triton kernels (`textcore.mxfp4_triton`) are imported only for CUDA tensors or
when a caller asks for them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

GROUP_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
FORMAT = "mxfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
# Magnitudes of the 3-bit E2M1 codes; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# floor(log2(E2M1_MAX)): the OCP rule puts a group's largest magnitude into [4, 8) before rounding.
E2M1_EMAX = 2
# Rounding thresholds between neighbouring magnitudes (midpoints). A tie goes to the even code,
# so ties at 0.25, 1.25, 2.5 and 5.0 round down and ties at 0.75, 1.75 and 3.5 round up.
_ROUND_UP_ABOVE = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_FROM = (0.75, 1.75, 3.5)

# Tensor-name suffixes of a quantised layer in a checkpoint.
PACKED_SUFFIX = "weight_packed"
SCALE_SUFFIX = "weight_scale"

# The published K3 config (docs/MODEL.md §12): weight-only MXFP4 on every Linear except the
# ignored ones, which in practice leaves only the routed experts' w1/w2/w3 packed.
K3_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": QUANT_METHOD,
    "format": FORMAT,
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "group_size": GROUP_SIZE,
                "strategy": "group",
                "dynamic": False,
                "scale_dtype": "torch.uint8",
            },
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    },
    "ignore": [
        r"re:.*self_attn.*",
        r"re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        r"re:.*lm_head.*",
        r"re:.*vision_tower.*",
        r"re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
}


# What the release actually stores packed: only the routed experts' w1/w2/w3 (docs/MODEL.md §12).
# Its config's ignore list leaves routed_expert_{down,up}_proj targeted too, yet the release keeps
# them dense, and the peers that load it (NeMo Automodel's adapter, SGLang) read them dense. The
# loader goes by the tensors present, so it takes either.
K3_PACKED_MODULES = re.compile(r"(^|\.)experts\.\d+\.w[123]$")


class MXFP4Error(ValueError):
    """Input that cannot be quantised, decoded or configured as MXFP4, with the reason."""


# ---------------------------------------------------------------------------------------------
# Codes and scales


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> float32 powers of two, built from the bits (exact, no exp2 rounding)."""
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)  # code 0 is 2^-127, a subnormal
    bits = torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


@functools.lru_cache(maxsize=16)
def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the (low nibble, high nibble) values of every byte, before scaling."""
    codes = torch.arange(16)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes & 7]
    values = torch.where(codes >= 8, -values, values)  # code 8 gives -0.0
    byte = torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=1).to(device=device, dtype=dtype)


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2:
        raise MXFP4Error(f"packed and scale must be 2-D, got shapes {list(packed.shape)} and {list(scale.shape)}")
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (out_features, in_features // GROUP_SIZE) or in_features % GROUP_SIZE:
        raise MXFP4Error(
            f"scale shape {list(scale.shape)} does not match packed shape {list(packed.shape)} "
            f"(expected [{out_features}, {in_features}/{GROUP_SIZE}] with {in_features} divisible by {GROUP_SIZE})"
        )
    return out_features, in_features


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D float weight `[out, in]` to MXFP4: `(packed uint8 [out, in/2], scale uint8 [out, in/32])`.

    OCP MX rule: a group's scale exponent is `floor(log2(amax)) - 2` clamped to [-127, 127]
    (stored +127; an all-zero group gets code 0); elements are divided by the scale, rounded to
    the nearest E2M1 value (ties to the even code) and saturated at 6. The sign is kept, so a
    negative element that rounds to zero becomes -0 (code 8).
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise MXFP4Error(f"quantize needs a floating-point tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() != 2:
        raise MXFP4Error(f"quantize needs a 2-D weight [out, in], got shape {list(w.shape)}")
    out_features, in_features = w.shape
    if in_features % GROUP_SIZE:
        raise MXFP4Error(f"in_features {in_features} of weight {list(w.shape)} is not divisible by {GROUP_SIZE}")
    if w.device.type == "meta":
        raise MXFP4Error("quantize needs real values; the weight is on the meta device")
    w32 = w.detach().to(torch.float32)
    finite = torch.isfinite(w32)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise MXFP4Error(
            f"weight {list(w.shape)} has {int((~finite).sum())} NaN/Inf values (first at {bad}); "
            "MXFP4 cannot represent them"
        )
    groups = w32.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, torch.full_like(exponent, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    # Divide by 2^shared exactly: shared is in [-127, 125] for finite float32 input, so 2^-shared
    # is a normal float32 and the multiply only shifts exponents.
    scaled = groups * torch.ldexp(torch.ones_like(amax), -shared)[..., None]
    mag = scaled.abs()
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for t in _ROUND_UP_ABOVE:
        code += mag > t
    for t in _ROUND_UP_FROM:
        code += mag >= t
    code |= torch.signbit(scaled).to(torch.uint8) << 3
    code = code.reshape(out_features, in_features)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scale = (shared + E8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode MXFP4 `(packed [out, in/2], scale [out, in/32])` to a dense `[out, in]` tensor.

    Every product `E2M1 value * 2^k` is exact in float32 (and in bf16); the result is then cast to
    `dtype` (so float16 rounds or overflows as a cast would).
    """
    out_features, in_features = _check_packed(packed, scale)
    # bf16 holds every E2M1 value times every E8M0 scale exactly (same exponent range as float32,
    # subnormals down to 2^-133), so a bf16 result is computed in bf16 (cheaper); others in float32.
    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    values = _byte_table(packed.device, compute).index_select(0, packed.reshape(-1).int())
    groups = values.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    return (groups * _scale_values(scale).to(compute)[..., None]).reshape(out_features, in_features).to(dtype)


# ---------------------------------------------------------------------------------------------
# Matrix products


# What the torch path decodes at a time (rows of W; the MoE loop: whole experts): bounds its
# float32 temporary to ~32 MiB.
_TORCH_CHUNK_BYTES = 32 * 1024**2


def _matmul_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` in float32, decoding W a block of rows at a time (never a whole dense copy)."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    x2 = x.reshape(-1, in_features).to(torch.float32)
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    rows = max(1, _TORCH_CHUNK_BYTES // (4 * in_features))
    for r0 in range(0, out_features, rows):
        w = dequantize(packed[r0 : r0 + rows], scale[r0 : r0 + rows], dtype=torch.float32)
        out[:, r0 : r0 + rows] = (x2 @ w.T).to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise MXFP4Error(f"unknown backend {backend!r} (expected 'auto', 'torch' or 'triton')")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """`x @ W.T` for an MXFP4 weight W `[out, in]`; x is `[..., in]`, the result `[..., out]` in x's dtype.

    backend "auto": the Triton kernel for CUDA tensors (W decoded tile by tile inside the kernel,
    never materialised), the torch path otherwise; "torch" / "triton" force one (Triton on CPU
    tensors needs TRITON_INTERPRET=1 set before the first import).
    """
    out_features, in_features = _check_packed(packed, scale)
    if x.shape[-1] != in_features:
        raise MXFP4Error(
            f"x has {x.shape[-1]} features, the weight [{out_features}, {in_features}] takes {in_features}"
        )
    if not x.is_floating_point():
        raise MXFP4Error(f"x must be floating point, got {x.dtype}")
    if _use_triton(x, backend):
        from textcore.mxfp4_triton import mxfp4_matmul

        y = mxfp4_matmul(x.reshape(-1, in_features), packed, scale)
        return y.reshape(*x.shape[:-1], out_features)
    return _matmul_torch(x, packed, scale)


def expert_matmul(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped expert GEMM: rows `expert_offsets[e]:expert_offsets[e+1]` of x (tokens sorted by
    expert) times expert e's weight. x `[T, in]`, expert_offsets int `[E+1]` (non-decreasing, from 0
    to T), packed `[E, out, in/2]`, scale `[E, out, in/32]` -> `[T, out]` in x's dtype."""
    if packed.dim() != 3 or scale.dim() != 3 or packed.shape[0] != scale.shape[0]:
        raise MXFP4Error(
            f"stacked expert weights must be [E, out, in/2] and [E, out, in/32], got "
            f"{list(packed.shape)} and {list(scale.shape)}"
        )
    _check_packed(packed[0], scale[0])
    num_experts, out_features, in_features = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    if x.dim() != 2 or x.shape[1] != in_features:
        raise MXFP4Error(f"x must be [tokens, {in_features}], got {list(x.shape)}")
    if expert_offsets.dim() != 1 or expert_offsets.shape[0] != num_experts + 1 or expert_offsets.is_floating_point():
        raise MXFP4Error(
            f"expert_offsets must be an integer [{num_experts + 1}] tensor, got {list(expert_offsets.shape)}"
        )
    if _use_triton(x, backend):
        from textcore.mxfp4_triton import mxfp4_expert_matmul

        return mxfp4_expert_matmul(x, expert_offsets, packed, scale)
    offsets = expert_offsets.tolist()
    if offsets[0] != 0 or offsets[-1] != x.shape[0] or any(a > b for a, b in zip(offsets, offsets[1:], strict=False)):
        raise MXFP4Error(f"expert_offsets must rise from 0 to {x.shape[0]}, got {offsets}")
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    for e in range(num_experts):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            out[a:b] = _matmul_torch(x[a:b], packed[e], scale[e])
    return out


# ---------------------------------------------------------------------------------------------
# Module


class MXFP4Linear(nn.Module):
    """A linear layer whose weight stays packed as MXFP4 (`weight_packed`, `weight_scale` buffers)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise MXFP4Error(f"in_features {in_features} is not divisible by {GROUP_SIZE}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            PACKED_SUFFIX, torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            SCALE_SUFFIX, torch.zeros(out_features, in_features // GROUP_SIZE, dtype=torch.uint8, device=device)
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXFP4Linear:
        """Swap-in for `linear`: quantises its weight, or stays empty if it lives on the meta device."""
        device = linear.weight.device
        q = cls(
            linear.in_features, linear.out_features, linear.bias is not None, device=device, dtype=linear.weight.dtype
        )
        if device.type != "meta":
            q.weight_packed, q.weight_scale = quantize(linear.weight)
            if linear.bias is not None:
                q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight_packed, self.weight_scale)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, mxfp4"


# ---------------------------------------------------------------------------------------------
# quantization_config (compressed-tensors schema)


def _match_name(name: str, target: str) -> bool:
    """compressed-tensors rule: `re:` targets are regexes matched at the start of the name, others exact."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _match_module(name: str, module: nn.Module | None, target: str, is_linear: bool) -> bool:
    if _match_name(name, target):
        return True
    if module is not None:
        return any(cls.__name__ == target for cls in type(module).__mro__)
    return target == "Linear" and is_linear


def _mxfp4_groups(quantization_config: Mapping[str, Any]) -> tuple[list[list[str]], list[str]]:
    """Validate a config as weight-only MXFP4; return (targets of each group, ignore list)."""
    if not isinstance(quantization_config, Mapping):
        raise MXFP4Error(f"quantization_config must be a JSON object, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method != QUANT_METHOD:
        raise MXFP4Error(f"quantization_config.quant_method is {method!r}; only {QUANT_METHOD!r} is supported")
    groups = quantization_config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise MXFP4Error("quantization_config has no config_groups")
    top_format = quantization_config.get("format")
    all_targets = []
    for gname, group in groups.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(group, Mapping):
            raise MXFP4Error(f"{where} must be a JSON object")
        fmt = group.get("format") or top_format
        if fmt != FORMAT:
            raise MXFP4Error(f"{where} has format {fmt!r}; only {FORMAT!r} is supported")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise MXFP4Error(f"{where}.weights is missing")
        expected = {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
        optional = {"strategy": "group", "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
        for key, want in expected.items():
            if weights.get(key) != want:
                raise MXFP4Error(f"{where}.weights.{key} is {weights.get(key)!r}; MXFP4 needs {want!r}")
        for key, want in optional.items():
            if weights.get(key, want) not in (want, None):
                raise MXFP4Error(f"{where}.weights.{key} is {weights.get(key)!r}; MXFP4 needs {want!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise MXFP4Error(f"{where}.{key} is set; only weight-only MXFP4 (bf16 activations) is supported")
        targets = group.get("targets")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise MXFP4Error(f"{where}.targets must be a non-empty list of strings")
        all_targets.append(targets)
    ignore = quantization_config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise MXFP4Error("quantization_config.ignore must be a list of strings")
    for pattern in [i for i in ignore if i.startswith("re:")] + [
        t for ts in all_targets for t in ts if t.startswith("re:")
    ]:
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise MXFP4Error(f"quantization_config has an invalid regex {pattern!r}: {e}") from None
    return all_targets, ignore


def _is_quantized(
    name: str, module: nn.Module | None, is_linear: bool, groups: list[list[str]], ignore: list[str]
) -> bool:
    if any(_match_module(name, module, ign, is_linear) for ign in ignore):
        return False
    return any(_match_module(name, module, t, is_linear) for targets in groups for t in targets)


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return prefix + name if prefix.endswith(".") else f"{prefix}.{name}"


def apply_quantization_config(module: nn.Module, quantization_config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Replace, in place, every `nn.Linear` the config quantises with an `MXFP4Linear`.

    Names are matched as full checkpoint names (`prefix` + module name). A layer on the meta
    device becomes an empty meta `MXFP4Linear` (so loading never creates a bf16 copy); a real
    one is quantised. Returns the full names of the swapped layers, sorted.
    """
    groups, ignore = _mxfp4_groups(quantization_config)
    chosen = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and _is_quantized(_join(prefix, name), child, True, groups, ignore)
    ]
    swapped = []
    for name, linear in chosen:
        if not name:
            raise MXFP4Error("apply_quantization_config cannot replace the root module itself; pass its parent")
        if linear.in_features % GROUP_SIZE:
            raise MXFP4Error(
                f"{_join(prefix, name)} is targeted by quantization_config but in_features {linear.in_features} "
                f"is not divisible by {GROUP_SIZE}"
            )
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child_name, MXFP4Linear.from_linear(linear))
        swapped.append(_join(prefix, name))
    return sorted(swapped)


def quantized_modules(
    names: Collection[str],
    quantization_config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    linear_modules: Collection[str],
) -> list[str]:
    """Module names (sorted) whose `X.weight` the config quantises, from checkpoint tensor names.

    Class targets such as `Linear` cannot be checked on bare tensors, so `linear_modules` names
    the nn.Linear layers (full checkpoint names, e.g. from the models built on the meta device).
    `shapes` is accepted for callers that have it; the decision needs only the names.
    """
    groups, ignore = _mxfp4_groups(quantization_config)
    linear = set(linear_modules)
    chosen = []
    for tensor_name in names:
        module_name, _, param = tensor_name.rpartition(".")
        if param == "weight" and _is_quantized(module_name, None, module_name in linear, groups, ignore):
            chosen.append(module_name)
    return sorted(chosen)


def quantize_tensors(
    tensors: Mapping[str, torch.Tensor],
    quantization_config: Mapping[str, Any],
    *,
    linear_modules: Collection[str],
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with every quantised layer's `X.weight` replaced by `X.weight_packed` and
    `X.weight_scale` (other tensors unchanged). Each tensor of `tensors` is read once, so a lazy
    mapping over a checkpoint is never held twice. See `quantized_modules` for `linear_modules`."""
    names = list(tensors.keys())
    targets = set(quantized_modules(names, quantization_config, {}, linear_modules=linear_modules))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        module_name, _, param = name.rpartition(".")
        if param == "weight" and module_name in targets:
            w = tensors[name]
            if not w.is_floating_point() or w.dim() != 2:
                raise MXFP4Error(f"{name} is targeted by quantization_config but is {w.dtype} {list(w.shape)}")
            try:
                packed, scale = quantize(w)
            except MXFP4Error as e:
                raise MXFP4Error(f"{name}: {e}") from None
            out[f"{module_name}.{PACKED_SUFFIX}"] = packed
            out[f"{module_name}.{SCALE_SUFFIX}"] = scale
        else:
            out[name] = tensors[name]
    return out
