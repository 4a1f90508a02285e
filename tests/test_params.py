"""`kimi-vision params`: the seeds' arithmetic, reproduced from the real modules on the meta device."""

import json

import pytest

from service.cli import main


@pytest.fixture(scope="module")
def k3_counts():
    from service.cli.params import counts

    return counts("k3")


def test_k3_matches_the_seeds(k3_counts):
    c = k3_counts
    assert c["total"] == pytest.approx(2.780e12, abs=0.0005e12)  # 2.780 T
    assert 104e9 <= c["active_per_token"] <= 105e9  # ~104-105 B (~26:1)
    assert c["routed_experts"] == 92 * 896 * 3 * 3584 * 3072  # 2.72 T expert pool
    assert c["routed_experts"] == pytest.approx(2.72e12, abs=0.005e12)
    assert c["attention"] == pytest.approx(36.2e9, abs=0.05e9)
    assert c["quantized"] == pytest.approx(2.727e12, abs=0.0005e12)
    assert c["disk_bytes"] == pytest.approx(1.56e12, rel=0.01)  # ~1.56 TB
    assert c["kda_state_bytes_fp32"] == 69 * 96 * 128 * 128 * 4  # 434 MB
    assert c["kda_state_bytes_fp32"] == pytest.approx(434e6, abs=0.5e6)
    assert c["mla_cache_bytes_per_token_fp8"] == 24 * 576 == 13.5 * 1024  # 13.5 KB
    assert c["reference_cache_bytes_per_token_bf16"] == pytest.approx(1.5e6, rel=0.02)  # 1.5 MB
    assert (c["kda_layers"], c["mla_layers"]) == (69, 24)
    assert c["vision"] + c["projector"] == c["total"] - c["text_total"]
    assert c["total"] / c["active_per_token"] == pytest.approx(26.7, abs=0.5)


def test_cli_json_tiny(capsys):
    assert main(["params", "--preset", "tiny", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    for key in ("total", "active_per_token", "routed_experts", "attention", "quantized", "disk_bytes",
                "kda_state_bytes_fp32", "mla_cache_bytes_per_token_fp8", "reference_cache_bytes_per_token_bf16",
                "vision", "projector"):
        assert isinstance(c[key], int) and c[key] > 0, key
    from textcore.config import tiny
    from textcore.model import random_weights

    # the meta-device count equals the tensors a tiny checkpoint really holds
    assert c["text_total"] == sum(t.numel() for t in random_weights(tiny(), 0).values())


def test_cli_table_and_bad_preset(capsys):
    assert main(["params", "--preset", "tiny"]) == 0
    assert "quantized" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["params", "--preset", "k4"])
