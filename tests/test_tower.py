"""MoonViT-3D tower + projector: math pinned against independent formulas, packing, shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vision.config import PRESETS, VisionConfig
from vision.encoder import model_input, param_counts
from vision.projector import Projector
from vision.tower import PositionGrid, VisionTower, apply_rope, check_grids, merge_patches, rope_2d, sincos_time_table

TINY = PRESETS["tiny"]



def random_image(h: int, w: int, seed: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (h * w, 3, 14, 14)).astype(np.float32), (1, h, w)


def test_param_counts_k3_on_meta():
    # 27 x (wqkv 1024x4608 + wo 1536x1024 + fc0/fc1 2x 1024x4096 + 2 norms) + patch conv
    # + 64x64x1024 grid + final norm; projector 4096^2 + 4096x7168 + 7168.
    assert param_counts("k3") == {"vision": 401_214_464, "projector": 46_144_512}


def test_packed_equals_per_image(tiny_encoder):
    grids = [(4, 6), (64, 64), (10, 2), (2, 2), (6, 14)]
    items = [random_image(h, w, i) for i, (h, w) in enumerate(grids)]
    packed = tiny_encoder.encode(items)
    for item, out in zip(items, packed, strict=True):
        alone = tiny_encoder.encode([item])[0]
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    # No attention across images: changing one image leaves the others' rows untouched.
    items2 = list(items)
    items2[1] = random_image(64, 64, 99)
    again = tiny_encoder.encode(items2)
    for i in (0, 2, 3, 4):
        torch.testing.assert_close(again[i], packed[i], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(again[1], packed[1])


def test_output_rows_and_width(tiny_encoder):
    for h, w in [(2, 2), (2, 30), (34, 4), (64, 64), (66, 62)]:
        out = tiny_encoder.encode([random_image(h, w, h * w)])[0]
        assert out.shape == ((h // 2) * (w // 2), TINY.text_hidden_size)
        assert torch.isfinite(out).all()


def bilinear_reference(grid: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Textbook bilinear resize, align_corners=False, no antialias: sample (i+0.5)*scale-0.5, clamp."""
    in_h, in_w, _ = grid.shape

    def taps(n_out: int, n_in: int):
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, src - lo

    y0, y1, fy = taps(out_h, in_h)
    x0, x1, fx = taps(out_w, in_w)
    top = grid[y0][:, x0] * (1 - fx)[None, :, None] + grid[y0][:, x1] * fx[None, :, None]
    bottom = grid[y1][:, x0] * (1 - fx)[None, :, None] + grid[y1][:, x1] * fx[None, :, None]
    return top * (1 - fy)[:, None, None] + bottom * fy[:, None, None]


def test_position_grid_as_is_at_64x64_and_bilinear_otherwise():
    cfg = VisionConfig(vt_hidden_size=8, vt_num_attention_heads=1, qkv_hidden_size=8)
    pos = PositionGrid(cfg)
    with torch.no_grad():
        pos.weight.copy_(torch.randn(64, 64, 8, dtype=torch.float64).float())
    same = pos(1, 64, 64)
    assert torch.equal(same, pos.weight.flatten(0, 1))  # raster order, untouched
    assert same.data_ptr() == pos.weight.data_ptr()  # the grid itself, no resampling pass
    grid = pos.weight.detach().double().numpy()
    for h, w in [(6, 10), (100, 30), (64, 2), (512, 512)]:
        got = pos(1, h, w).detach().numpy().reshape(h, w, 8)
        np.testing.assert_allclose(got, bilinear_reference(grid, h, w), rtol=0, atol=1e-4)


def test_time_table_for_frames():
    d = 8
    table = sincos_time_table(d, 4).numpy()
    omega = 1.0 / 10000 ** (np.arange(d // 2) / (d / 2))
    t = np.arange(4)[:, None]
    np.testing.assert_allclose(table, np.concatenate([np.sin(t * omega), np.cos(t * omega)], 1), atol=1e-6)
    cfg = VisionConfig(vt_hidden_size=d, vt_num_attention_heads=1, qkv_hidden_size=8)
    pos = PositionGrid(cfg)
    with torch.no_grad():
        pos.weight.normal_()
    three = pos(3, 4, 6).detach().view(3, 24, d)
    one = pos(1, 4, 6).detach()
    for f in range(3):
        torch.testing.assert_close(three[f], one + torch.from_numpy(table[f]))


def test_rope_layout_x_then_y():
    head_dim, h, w = 16, 3, 5
    cis = rope_2d([(1, h, w)], head_dim, torch.device("cpu"))
    assert cis.shape == (h * w, head_dim // 2) and cis.dtype == torch.complex64
    freqs = [1.0 / 10000 ** (4 * i / head_dim) for i in range(head_dim // 4)]
    for p in range(h * w):
        y, x = divmod(p, w)  # raster order: row-major over the patch grid
        for i, f in enumerate(freqs):
            assert cmath_close(cis[p, 2 * i], x * f), (p, i, "slot 2i must rotate with x (column)")
            assert cmath_close(cis[p, 2 * i + 1], y * f), (p, i, "slot 2i+1 must rotate with y (row)")
    # Frames of one image share the same 2-D positions.
    torch.testing.assert_close(rope_2d([(2, h, w)], head_dim, torch.device("cpu")), cis.repeat(2, 1))


def cmath_close(z: torch.Tensor, angle: float) -> bool:
    return abs(complex(z) - complex(math.cos(angle), math.sin(angle))) < 1e-5


def test_apply_rope_rotates_adjacent_channel_pairs():
    head_dim = 8
    x = torch.zeros(1, 1, head_dim)
    x[0, 0, 2] = 1.0  # real part of complex slot 1 (channels 2, 3)
    cis = torch.polar(torch.ones(1, head_dim // 2), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    out = apply_rope(x, cis)[0, 0]
    expected = torch.zeros(head_dim)
    expected[2], expected[3] = math.cos(0.5), math.sin(0.5)
    torch.testing.assert_close(out, expected)


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    head_dim = 16
    q, k = torch.randn(1, 1, head_dim), torch.randn(1, 1, head_dim)
    cis = rope_2d([(1, 8, 8)], head_dim, torch.device("cpu"))

    def score(pq: int, pk: int) -> float:
        return float((apply_rope(q, cis[pq : pq + 1]) * apply_rope(k, cis[pk : pk + 1])).sum())

    # (y=1,x=2)->(y=3,x=5) and (y=4,x=0)->(y=6,x=3): same offset, same score.
    assert score(1 * 8 + 2, 3 * 8 + 5) == pytest.approx(score(4 * 8 + 0, 6 * 8 + 3), abs=1e-4)
    assert score(1 * 8 + 2, 3 * 8 + 5) != pytest.approx(score(1 * 8 + 2, 5 * 8 + 3), abs=1e-3)


def test_merger_groups_2x2_blocks_and_averages_frames():
    d, h, w = 3, 4, 6
    x = torch.arange(h * w, dtype=torch.float32)[:, None].repeat(1, d) * torch.tensor([1.0, 10.0, 100.0])
    merged = merge_patches(x, [(1, h, w)])
    assert merged.shape == ((h // 2) * (w // 2), 4 * d)
    for i in range(h // 2):
        for j in range(w // 2):
            row = merged[i * (w // 2) + j].view(4, d)
            for k, (dy, dx) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
                torch.testing.assert_close(row[k], x[(2 * i + dy) * w + 2 * j + dx])
    two = merge_patches(torch.cat([x, x + 2.0]), [(2, h, w)])
    torch.testing.assert_close(two, merged + 1.0)


def test_k3_shapes_on_meta():
    cfg = PRESETS["k3"]
    with torch.device("meta"):
        tower, projector = VisionTower(cfg), Projector(cfg)
        merged = tower(torch.empty(4 * 6 + 64 * 64, 3, 14, 14), [(1, 4, 6), (1, 64, 64)])
        rows = projector(merged)
    assert merged.shape == (6 + 32 * 32, 4096)
    assert rows.shape == (6 + 32 * 32, 7168)


def test_tower_rejects_bad_grids(tiny_encoder):
    pixels, _ = random_image(4, 6, 0)
    with pytest.raises(ValueError, match="multiple of the 2x2 merger"):
        tiny_encoder.tower(torch.from_numpy(pixels[:15]), [(1, 3, 5)])
    with pytest.raises(ValueError, match="describe 24 patches but 20"):
        tiny_encoder.tower(torch.from_numpy(pixels[:20]), [(1, 4, 6)])
    with pytest.raises(ValueError, match="each side must be 1..512"):
        tiny_encoder.tower(torch.zeros(2 * 514, 3, 14, 14), [(1, 2, 514)])
    with pytest.raises(ValueError, match="do not match grid_thw"):
        tiny_encoder.encode([(pixels, (1, 2, 6))])


def test_pixels_that_do_not_match_their_grid_are_refused():
    pixels = torch.zeros(24, 3, 14, 14)
    with pytest.raises(ValueError, match="do not match grid_thw"):
        model_input((pixels, (1, 4, 4)))
    with pytest.raises(ValueError, match="multiple of the 2x2 merger"):
        check_grids([(1, 3, 5)], 15, VisionConfig())
