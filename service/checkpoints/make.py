"""Deterministic random checkpoints in the published Kimi-K3 directory layout.

A checkpoint is assembled from *parts*. Each part contributes tensors (with their release
names), top-level `config.json` keys, and extra files (`preprocessor_config.json`, tokenizer
files, ...). Adding a sub-model is one line in `PARTS`. Parts must not collide: the same tensor
name, config key or file from two parts is an error, never a silent overwrite.

Every tensor is drawn from its own generator seeded by (seed, tensor name), so the weights of
one part never depend on which other parts exist or in what order they are listed.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from textcore.config import TextConfig
from textcore.config import preset as text_preset
from textcore.model import MULTIMODAL_PREFIX, KimiLinearForCausalLM, random_weights
from textcore.mxfp4 import K3_PACKED_MODULES, K3_QUANTIZATION_CONFIG, quantize_tensors
from textcore.tiny_vocab import tiny_tokenizer_files
from textcore.tokenizer import MEDIA_PAD_ID
from vision.checkpoint import write_checkpoint
from vision.config import VisionConfig
from vision.config import preset as vision_preset
from vision.encoder import PROJECTOR_PREFIX, TOWER_PREFIX
from vision.preprocess import processor_config
from vision.projector import Projector
from vision.tower import VisionTower

GENERATOR_VERSION = "k3-3"  # bump when any part's output changes (keys the embedded default's cache)

@dataclass
class CheckpointPart:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # top-level config.json keys
    json_files: dict[str, dict] = field(default_factory=dict)  # name -> JSON content
    files: dict[str, bytes] = field(default_factory=dict)  # name -> raw bytes (e.g. tiktoken.model)


def seeded_normal(name: str, shape: tuple[int, ...], std: float, seed: int, mean: float = 0.0) -> torch.Tensor:
    """float32 N(mean, std^2) of `shape`, a pure function of (seed, name)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * std + mean


def vision_part(preset: str, seed: int) -> CheckpointPart:
    """`vision_tower.*` + `mm_projector.*` (bf16, as released), `vision_config`, `preprocessor_config.json`."""
    cfg = vision_preset(preset)
    with torch.device("meta"):
        modules = {TOWER_PREFIX: VisionTower(cfg), PROJECTOR_PREFIX: Projector(cfg)}
    tensors = {}
    for prefix, module in modules.items():
        for key, p in module.state_dict().items():
            name = prefix + key
            shape = tuple(p.shape)
            owner = key.rsplit(".", 2)[-2]  # the module holding this tensor: norm0, wqkv, post_norm, ...
            if "norm" in owner:
                t = seeded_normal(name, shape, 0.1, seed, mean=1.0)  # norm gains near 1, not all equal
            elif key == "patch_embed.pos_emb.weight":
                t = seeded_normal(name, shape, 0.5, seed)
            else:  # weight matrices (and the patch conv): fan-in scaling keeps activations O(1)
                fan_in = math.prod(shape[1:])
                t = seeded_normal(name, shape, 1.0 / math.sqrt(fan_in), seed)
            tensors[name] = t.to(torch.bfloat16)
    return CheckpointPart(
        tensors=tensors,
        config={
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "media_placeholder_token_id": MEDIA_PAD_ID,
            "torch_dtype": "bfloat16",
            "vision_config": cfg.to_json(),
        },
        json_files={"preprocessor_config.json": {"media_proc_cfg": processor_config()}},
    )


def trunk_part(preset: str, seed: int) -> CheckpointPart:
    """`language_model.*` (bf16 as released; fp32 where the reference keeps fp32) + `text_config`."""
    cfg = text_preset(preset)
    return CheckpointPart(tensors=random_weights(cfg, seed), config={"text_config": cfg.to_dict()})


def tokenizer_part(preset: str, seed: int) -> CheckpointPart:
    """The tokenizer files. The release vocabulary is not ours to ship: every preset gets the tiny
    vocabulary the project generates itself (same special ids, so the prompts line up)."""
    return CheckpointPart(files=tiny_tokenizer_files())


# One line per sub-model.
PARTS: list[Callable[[str, int], CheckpointPart]] = [
    vision_part,
    trunk_part,
    tokenizer_part,
]


def merge_parts(parts: list[CheckpointPart]) -> CheckpointPart:
    out = CheckpointPart()
    for part in parts:
        for attr in ("tensors", "config", "json_files", "files"):
            have, new = getattr(out, attr), getattr(part, attr)
            both = sorted(set(have) & set(new))
            # Identical values (e.g. model_type) may be repeated; anything else is a conflict.
            clash = [k for k in both if not _same(have[k], new[k])]
            if clash:
                raise ValueError(f"checkpoint parts disagree on {attr}: {clash}")
            have.update(new)
    json_names = set(out.json_files) | {"config.json"}
    if json_names & set(out.files):
        raise ValueError(f"files given both as JSON and raw bytes: {sorted(json_names & set(out.files))}")
    text_hidden = (out.config.get("text_config") or {}).get("hidden_size")
    vision_text_hidden = (out.config.get("vision_config") or {}).get("text_hidden_size")
    if text_hidden is not None and vision_text_hidden is not None and text_hidden != vision_text_hidden:
        raise ValueError(f"projector width {vision_text_hidden} != text_config.hidden_size {text_hidden}")
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def linear_module_names(config: dict) -> set[str]:
    """Full checkpoint names of the nn.Linear layers of the models `config` describes (a trunk via
    `text_config` under `language_model.`, or a text-only config; a tower and projector via
    `vision_config`). Class targets such as `Linear` in a quantization_config need these: bare
    tensor names cannot tell a Linear weight from e.g. the router's."""
    models: list[tuple[str, nn.Module]] = []
    with torch.device("meta"):
        if "text_config" in config or "linear_attn_config" in config:
            prefix = MULTIMODAL_PREFIX if "text_config" in config else ""
            models.append((prefix, KimiLinearForCausalLM(TextConfig.from_dict(config.get("text_config", config)))))
        if "vision_config" in config:
            vision = VisionConfig.from_checkpoint_config(config)
            models += [(TOWER_PREFIX, VisionTower(vision)), (PROJECTOR_PREFIX, Projector(vision))]
    if not models:
        raise ValueError("describes neither a KimiLinear trunk (text_config) nor a vision tower (vision_config)")
    return {prefix + n for prefix, model in models for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def packed_linears(config: dict, quantization_config: dict) -> set[str]:
    """The Linear layers a checkpoint written with `quantization_config` may store packed: those of
    `linear_module_names`, and with the K3 config only the routed experts' w1/w2/w3, as the
    release stores them (`textcore.mxfp4.K3_PACKED_MODULES`)."""
    linear = linear_module_names(config)
    if quantization_config == K3_QUANTIZATION_CONFIG:
        linear = {name for name in linear if K3_PACKED_MODULES.search(name)}
    return linear


def make_checkpoint(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    parts: list[Callable[[str, int], CheckpointPart]] | None = None,
    mxfp4: bool = True,
) -> Path:
    """Write a deterministic random checkpoint (same preset + seed -> byte-identical files).

    With `mxfp4` (the default, as released) the K3 `quantization_config` is written and, as in the
    release, the routed experts' w1/w2/w3 are stored packed (everything else dense).
    """
    merged = merge_parts([build(preset, seed) for build in (PARTS if parts is None else parts)])
    tensors, config = merged.tensors, dict(merged.config)
    if mxfp4 and "text_config" in config:
        tensors = quantize_tensors(tensors, K3_QUANTIZATION_CONFIG,
                                   linear_modules=packed_linears(config, K3_QUANTIZATION_CONFIG))
        config["quantization_config"] = K3_QUANTIZATION_CONFIG
    out = write_checkpoint(out_dir, tensors, config, json_files=merged.json_files)
    for name, data in merged.files.items():
        (out / name).write_bytes(data)
    return out
