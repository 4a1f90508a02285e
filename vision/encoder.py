"""Images -> embedding rows for the text trunk: the tower and projector loaded from a checkpoint.

One `encode` call packs all its images into one forward pass (attention stays per image), then
splits the projector output back into one `[num_tokens, text_hidden]` tensor per image.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from vision.checkpoint import Checkpoint, CheckpointError
from vision.config import VisionConfig, preset
from vision.preprocess import Preprocessed
from vision.projector import Projector
from vision.tower import Grid, VisionTower

TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."
# What the tower takes for one image: a `vision.Preprocessed`, or `(pixel_values, grid_thw)` with
# pixel_values float32 [N, 3, 14, 14] (a numpy array or a tensor on the encoder's device).
ModelInput = Preprocessed | tuple[np.ndarray | torch.Tensor, Sequence[int]]


def model_input(item: ModelInput) -> tuple[torch.Tensor, Grid]:
    """`(pixel_values [N,3,14,14] float32 tensor, (t, h, w))` of one image."""
    if isinstance(item, Preprocessed):
        pixels, grid = item.pixel_values, item.grid_thw
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        pixels, grid = item
    else:
        raise TypeError(f"expected a vision.Preprocessed or a (pixel_values, grid_thw) pair, got {type(item).__name__}")
    if isinstance(pixels, np.ndarray):
        with warnings.catch_warnings():  # read-only arrays are fine: the tower never writes its input
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            pixels = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"pixel_values must be a numpy array or a tensor, got {type(pixels).__name__}")
    grid = tuple(int(v) for v in grid)
    if len(grid) != 3:
        raise ValueError(f"grid_thw must be (t, h, w), got {grid}")
    if pixels.ndim != 4 or pixels.shape[0] != grid[0] * grid[1] * grid[2]:
        raise ValueError(f"pixel_values {list(pixels.shape)} do not match grid_thw {grid}")
    check_num_tokens(item.num_tokens if isinstance(item, Preprocessed) else None, grid)
    return pixels, grid  # type: ignore[return-value]


def check_num_tokens(num_tokens: int | None, grid: Grid) -> None:
    """A stated token count must be the grid's 2x2-merged size (None: nothing stated)."""
    if num_tokens is not None and num_tokens != (grid[1] // 2) * (grid[2] // 2):
        raise ValueError(f"num_tokens {num_tokens} does not match grid_thw {grid}")


def check_checkpoint(ckpt: Checkpoint) -> VisionConfig:
    """The checkpoint's vision config, after checking every `vision_tower.*` / `mm_projector.*`
    name and shape against it (metadata only: nothing is read or allocated)."""
    try:
        config = VisionConfig.from_checkpoint_config(ckpt.config)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: {e}") from None
    with torch.device("meta"):
        for prefix, module in ((TOWER_PREFIX, VisionTower(config)), (PROJECTOR_PREFIX, Projector(config))):
            ckpt.check({k: tuple(v.shape) for k, v in module.state_dict().items()}, prefix)
    return config


def default_dtype(device: torch.device) -> torch.dtype:
    """The release runs the tower in bf16; CPU gets float32 (bf16 matmuls are slow and inexact there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class VisionEncoder:
    """Tower + projector on one device. Not thread-safe; one per process or device."""

    def __init__(self, config: VisionConfig, tower: VisionTower, projector: Projector):
        self.config = config
        self.tower = tower.eval()
        self.projector = projector.eval()

    @property
    def device(self) -> torch.device:
        return self.tower.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.patch_embed.proj.weight.dtype

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str] | Checkpoint,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> VisionEncoder:
        """Build on the meta device (no allocation), then load `vision_tower.*` and `mm_projector.*`
        strictly: any missing, unexpected or mis-shaped tensor is one `CheckpointError`."""
        ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
        config = check_checkpoint(ckpt)
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        with torch.device("meta"):
            tower, projector = VisionTower(config).to(dtype), Projector(config).to(dtype)
        ckpt.load_into(tower, TOWER_PREFIX)
        ckpt.load_into(projector, PROJECTOR_PREFIX)
        if ckpt is not path:
            ckpt.close()
        return cls(config, tower.to(device), projector.to(device))

    @torch.inference_mode()
    def encode(self, items: Sequence[ModelInput]) -> list[torch.Tensor]:
        """One `[num_tokens, text_hidden]` tensor per image (on this encoder's device and dtype)."""
        if not items:
            return []
        inputs = [model_input(it) for it in items]
        pixels = torch.cat([p for p, _ in inputs]) if len(inputs) > 1 else inputs[0][0]
        grids = [g for _, g in inputs]
        merged = self.tower(pixels, grids)
        rows = self.projector(merged)
        return list(rows.split([(h // 2) * (w // 2) for _, h, w in grids]))


def param_counts(preset_name: str) -> dict[str, int]:
    """Parameter counts of the tower and the projector of a preset, built on the meta device (no memory)."""
    cfg = preset(preset_name)
    with torch.device("meta"):
        tower, projector = VisionTower(cfg), Projector(cfg)
    return {
        "vision": sum(p.numel() for p in tower.parameters()),
        "projector": sum(p.numel() for p in projector.parameters()),
    }
