"""KimiLinear text-trunk configuration: the K3 numbers (docs/MODEL.md §10) and a tiny test preset.

`TextConfig.from_dict` reads the published `text_config` (or a text-only `config.json`), nesting
`linear_attn_config` as the release does; `to_dict` writes the same form back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODEL_TYPE = "kimi_linear"
END_OF_MSG = 163586  # generation stops here (generation_config eos_token_id)
VOCAB_SIZE = 163840


def _k3_full_attn_layers() -> list[int]:
    # 1-based: every 4th layer, and the stack ends with two global layers (92, 93)
    return [*range(4, 93, 4), 93]


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense SiTU FFN of the first_k_dense_replace layers
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int  # latent width the routed experts run in
    num_shared_experts: int
    attn_res_block_size: int
    kda_num_heads: int
    kda_head_dim: int
    full_attn_layers: tuple[int, ...]  # 1-based; every other layer is KDA
    first_k_dense_replace: int = 1
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    rms_norm_eps: float = 1e-5
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    quantization_config: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        bad = [i for i in self.full_attn_layers if not 1 <= i <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"full_attn_layers {bad} outside 1..{self.num_hidden_layers} (1-based)")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not the KimiLinear layout (lm_head is separate)")
        if not -5.0 <= self.gate_lower_bound < 0:
            raise ValueError(f"gate_lower_bound {self.gate_lower_bound}: chunked KDA supports [-5, 0) (K3: -5)")
        if self.num_expert_group != 1:
            raise ValueError(f"num_expert_group {self.num_expert_group}: only 1 group (K3) is implemented")

    # ---- layer kinds (the config lists are 1-based) ----
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers)

    def is_kda(self, i: int) -> bool:
        """0-based layer i is a KDA layer (otherwise gated MLA)."""
        return (i + 1) in self.kda_layers

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    # ---- published config form ----
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("kda_num_heads", "kda_head_dim", "full_attn_layers", "short_conv_kernel_size", "gate_lower_bound"):
            d.pop(key)
        if d["quantization_config"] is None:
            d.pop("quantization_config")
        d.pop("mla_norm_eps")
        d.update(
            model_type=MODEL_TYPE,
            architectures=["KimiLinearForCausalLM"],
            hidden_act="situ",
            mla_use_nope=True,
            mla_use_output_gate=True,
            latent_moe_use_norm=True,
            moe_router_activation_func="sigmoid",
            topk_method="noaux_tc",
            num_nextn_predict_layers=0,
            linear_attn_config={
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound,
                "use_full_rank_gate": True,
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": list(self.kda_layers),
            },
        )
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TextConfig:
        """Accepts a text config or a multimodal config (its `text_config` is used)."""
        if "text_config" in d:
            d = d["text_config"]
        lac = d.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ValueError("text config has no linear_attn_config object")
        if d.get("hidden_act", "situ") != "situ":
            raise ValueError(f"hidden_act {d.get('hidden_act')!r}: only 'situ' is implemented")
        if not lac.get("use_full_rank_gate", True):
            raise ValueError("linear_attn_config.use_full_rank_gate=false (low-rank gate) is not implemented")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "full_attn_layers" in lac:
            full = tuple(lac["full_attn_layers"])
        elif "kda_layers" in lac:
            kda = set(lac["kda_layers"])
            full = tuple(i for i in range(1, d["num_hidden_layers"] + 1) if i not in kda)
        else:
            raise ValueError("linear_attn_config names neither full_attn_layers nor kda_layers")
        kwargs.update(
            kda_num_heads=lac["num_heads"],
            kda_head_dim=lac["head_dim"],
            full_attn_layers=full,
            short_conv_kernel_size=lac.get("short_conv_kernel_size", 4),
            gate_lower_bound=lac.get("gate_lower_bound", -5.0),
        )
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in kwargs)
        if missing:
            raise ValueError(f"text config lacks {', '.join(missing)}")
        return cls(**kwargs)


def k3() -> TextConfig:
    return TextConfig(
        hidden_size=7168,
        num_hidden_layers=93,
        vocab_size=VOCAB_SIZE,
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=33792,
        num_experts=896,
        num_experts_per_token=16,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        num_shared_experts=2,
        attn_res_block_size=12,
        kda_num_heads=96,
        kda_head_dim=128,
        full_attn_layers=tuple(_k3_full_attn_layers()),
    )


def tiny() -> TextConfig:
    """Same structure at toy width: KDA and MLA layers (ending with two MLA layers like K3), three
    AttnRes blocks, dense layer 0 then Latent MoE, real vocabulary so real token ids work."""
    return TextConfig(
        hidden_size=64,
        num_hidden_layers=7,
        vocab_size=VOCAB_SIZE,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,  # multiple of 32: the experts can be MXFP4-packed
        routed_expert_hidden_size=32,
        num_shared_experts=2,
        attn_res_block_size=3,
        kda_num_heads=4,
        kda_head_dim=8,
        full_attn_layers=(3, 6, 7),
    )


PRESETS = {"k3": k3, "tiny": tiny}


def preset(name: str) -> TextConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown text preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
