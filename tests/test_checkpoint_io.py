import json

import pytest
import torch

from vision.checkpoint import Checkpoint, CheckpointError, write_checkpoint


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3, bias=False)
        self.register_buffer("codes", torch.zeros(3, 2, dtype=torch.uint8))


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "m.a.weight": torch.randn(3, 4, generator=g, dtype=torch.bfloat16),
        "m.codes": torch.arange(6, dtype=torch.uint8).view(3, 2),
        "other.x": torch.ones(5),
    }


def test_write_is_deterministic_and_sharded(tmp_path):
    write_checkpoint(tmp_path / "a", _tensors(), {"k": 1}, max_shard_bytes=16)
    write_checkpoint(tmp_path / "b", _tensors(), {"k": 1}, max_shard_bytes=16)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_load_into_meta_module_through_symlinked_snapshot(tmp_path):
    write_checkpoint(tmp_path / "blobs", _tensors(), {"k": 1})
    (tmp_path / "snapshot").symlink_to(tmp_path / "blobs")
    ckpt = Checkpoint(tmp_path / "snapshot")
    with torch.device("meta"):
        m = Two()
    ckpt.load_into(m, "m.")
    assert m.a.weight.dtype == torch.float32  # cast to what the module declares
    assert torch.equal(m.a.weight, _tensors()["m.a.weight"].float())
    assert m.codes.dtype == torch.uint8 and m.codes.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_mismatch_lists_every_problem(tmp_path):
    t = _tensors()
    t["m.a.weight"] = torch.zeros(3, 5)
    t["m.extra"] = torch.zeros(1)
    del t["m.codes"]
    write_checkpoint(tmp_path, t, {})
    with pytest.raises(CheckpointError) as e:
        Checkpoint(tmp_path).load_into(Two(), "m.")
    msg = str(e.value)
    assert "1 missing tensors: m.codes" in msg
    assert "1 unexpected tensors: m.extra" in msg
    assert "m.a.weight [3, 5] (expected [3, 4])" in msg


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint(tmp_path)
