"""`kimi-vision params --preset k3|tiny [--json]`: parameter, disk and cache arithmetic of a preset.

Counted from the real modules on the meta device (nothing is allocated): the text trunk
(`textcore.params.trunk_counts`) and the vision tower and projector (`vision.encoder.param_counts`).
`total` and `disk_bytes` cover the whole checkpoint (trunk + tower + projector); `text_total` is
the trunk alone; `active_per_token` is per text token.
"""

from __future__ import annotations

import argparse
import json

PRESETS = ("k3", "tiny")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="k3", help="model preset (default k3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def counts(preset: str) -> dict[str, int]:
    from textcore.config import preset as text_preset
    from textcore.params import CHECKPOINT_DTYPE, trunk_counts
    from vision.encoder import param_counts

    text = trunk_counts(text_preset(preset))
    vision = param_counts(preset)
    out = {"text_total": text["total"], **text}
    out.update(vision=vision["vision"], projector=vision["projector"])
    tower = vision["vision"] + vision["projector"]
    out["total"] = text["total"] + tower
    out["disk_bytes"] = text["disk_bytes"] + tower * CHECKPOINT_DTYPE.itemsize  # the tower is never packed
    return out


def _human(key: str, value: int) -> str:
    if "bytes" in key:
        for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
            if value >= size:
                return f"{value / size:.3f} {unit}"
        return f"{value} B"
    if key.endswith("_layers"):
        return str(value)
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.3f} {unit}"
    return str(value)


def run(args: argparse.Namespace) -> int:
    result = counts(args.preset)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            print(f"{key:<{width}}  {value:>18,}  ({_human(key, value)})")
    return 0
