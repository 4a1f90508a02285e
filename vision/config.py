"""MoonViT-3D tower + projector configuration (docs/MODEL.md §8, §9).

Field names are the release's `config.json` `vision_config` keys, so `to_json()` writes and
`from_checkpoint_config()` reads the published layout. Structural switches the release fixes
(RMSNorm, no bias, tanh-GELU MLP, bilinear position grid, 2x2 temporal-pool merger,
`patchmergerv2` projector) are written out for fidelity and checked on read: a checkpoint
asking for anything else is refused instead of silently run with the wrong math.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Release values of the switches this implementation supports (and only these).
FIXED_FIELDS: dict[str, Any] = {
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "projector_hidden_act": "gelu",
    "activation_func": "gelu_pytorch_tanh",
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
}

ROPE_THETA = 10000.0  # the reference hard-codes it; not a config key
MAX_GRID_SIDE = 512  # the reference precomputes RoPE for at most 512 x 512 patches


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    vt_hidden_size: int = 1024
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168

    def __post_init__(self) -> None:
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ValueError(
                f"qkv_hidden_size {self.qkv_hidden_size} is not divisible by {self.vt_num_attention_heads} heads"
            )
        if self.head_dim % 4:
            raise ValueError(f"head dim {self.head_dim} must be divisible by 4 for the 2-D RoPE")
        if self.vt_hidden_size % 2:
            raise ValueError("vt_hidden_size must be even (sincos time table)")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: 2x2 patches side by side (the release's mm_hidden_size x 4)."""
        return self.vt_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        d["mm_hidden_size"] = self.vt_hidden_size
        d.update(FIXED_FIELDS)
        return d

    @classmethod
    def from_checkpoint_config(cls, config: dict[str, Any]) -> VisionConfig:
        """Build from a top-level `config.json` dict. The projector's output width is the text
        trunk's hidden size (`text_config.hidden_size`) when the checkpoint has a trunk, else
        `vision_config.text_hidden_size`; if both exist they must agree."""
        vc = config.get("vision_config")
        if not isinstance(vc, dict):
            raise ValueError("config.json has no vision_config object")
        wrong = {k: vc[k] for k, v in FIXED_FIELDS.items() if k in vc and vc[k] != v}
        if wrong:
            raise ValueError(f"vision_config asks for unsupported variants {wrong}; supported: {FIXED_FIELDS}")
        mm_hidden = vc.get("mm_hidden_size")
        if mm_hidden is not None and mm_hidden != vc.get("vt_hidden_size", cls.vt_hidden_size):
            raise ValueError(f"vision_config mm_hidden_size {mm_hidden} differs from vt_hidden_size")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in vc:
                kwargs[f.name] = vc[f.name]
        if "merge_kernel_size" in kwargs:
            mks = kwargs["merge_kernel_size"]
            kwargs["merge_kernel_size"] = (mks, mks) if isinstance(mks, int) else tuple(mks)
        if tuple(kwargs.get("merge_kernel_size", (2, 2))) != (2, 2):
            raise ValueError(f"merge_kernel_size {kwargs['merge_kernel_size']} unsupported (the merger is 2x2)")
        text_hidden = (config.get("text_config") or {}).get("hidden_size")
        if text_hidden is not None:
            if "text_hidden_size" in vc and vc["text_hidden_size"] != text_hidden:
                raise ValueError(
                    f"vision_config.text_hidden_size {vc['text_hidden_size']} != text_config.hidden_size {text_hidden}"
                )
            kwargs["text_hidden_size"] = text_hidden
        elif "text_hidden_size" not in vc:
            raise ValueError("config.json gives the projector no output width (no text_config.hidden_size)")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"bad vision_config: {e}") from None


PRESETS: dict[str, VisionConfig] = {
    "k3": VisionConfig(),
    # Same structure (64x64 position grid, 2-D RoPE, 2x2 merger, projector), small widths.
    "tiny": VisionConfig(
        vt_hidden_size=64,
        vt_num_attention_heads=2,
        vt_num_hidden_layers=2,
        vt_intermediate_size=128,
        qkv_hidden_size=64,
        text_hidden_size=64,
    ),
}


def preset(name: str) -> VisionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None

