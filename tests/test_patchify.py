"""pixel_values built from the padded uint8 image on a torch device (vision.patchify) against the
host path (vision.preprocess.patchify_normalise), and the caller-owned output buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from images import png

from vision import preprocess_image
from vision.buffers import BufferPool
from vision.patchify import check_normalise, patchify_on_device
from vision.preprocess import NORMALISE_TABLE, patchify_normalise, plan_image, preprocess_patches

# Padded (height, width) classes: the smallest image; one-token strips at the 7,168-px side limit,
# both ways; odd patch counts per side (the 14-px patch grid is not the 28-px token grid's double
# in raster order); a 4:3 photo; the 12 MP JPEG's 4004 x 3024 canvas.
PADDED_SIZES = [(28, 28), (28, 7168), (7168, 28), (252, 224), (1092, 1456), (3024, 4004)]


def _noise(h: int, w: int, seed: int) -> np.ndarray:
    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every value occurs
    return image


@pytest.mark.parametrize(("h", "w"), PADDED_SIZES, ids=lambda v: str(v))
def test_device_patchify_equals_the_host_path_bit_for_bit(h, w, torch_one_thread):
    image = _noise(h, w, seed=h + w)
    host = torch.from_numpy(patchify_normalise(image))
    device = patchify_on_device(torch.from_numpy(image))
    assert device.dtype == torch.float32 and device.shape == host.shape == (h // 14 * (w // 14), 3, 14, 14)
    assert device.is_contiguous()
    assert torch.equal(device.view(torch.int32), host.view(torch.int32))  # bit patterns, not values


def test_normalise_check_on_the_device_and_what_it_catches(monkeypatch):
    check_normalise("cpu")
    # What CUDA does to a division by a Python number: a multiplication by the float32 reciprocal.
    import vision.patchify as patchify

    monkeypatch.setattr(patchify, "normalise_", lambda v: v.mul_(1 / 255).sub_(0.5).mul_(2.0))
    with pytest.raises(RuntimeError, match=r"normalisation on cpu differs from the reference on 111 of 256 values"):
        check_normalise("cpu")
    assert NORMALISE_TABLE.dtype == np.float32


def test_both_paths_refuse_what_is_not_a_padded_uint8_image():
    with pytest.raises(ValueError, match="expected a uint8"):
        patchify_on_device(torch.zeros(28, 28, 3))
    with pytest.raises(ValueError, match="not a multiple of the 14-px patch"):
        patchify_on_device(torch.zeros(28, 30, 3, dtype=torch.uint8))
    for image in (np.zeros((28, 28, 3), np.float32), np.zeros((28, 28, 4), np.uint8), np.zeros((28, 28), np.uint8)):
        with pytest.raises(ValueError, match="expected a uint8"):
            patchify_normalise(image)
    with pytest.raises(ValueError, match="not a multiple of the 14-px patch"):
        patchify_normalise(np.zeros((28, 30, 3), np.uint8))




def test_outputs_built_in_caller_buffers_equal_fresh_ones():
    images, patches = BufferPool(np.uint8), BufferPool(np.float32)
    for w, h, seed in [(300, 200, 1), (60, 90, 2), (301, 199, 3)]:  # large, small (stale bytes after it), large
        data = png(w, h, seed=seed)
        fresh = preprocess_image(data)
        plan = plan_image(data)
        with images.take(plan.image_bytes) as buffer, patches.take(plan.pixel_values_size) as values:
            pre = preprocess_image(data, out=buffer)
            assert np.shares_memory(pre.image, buffer) and not pre.image.flags.writeable
            assert np.array_equal(pre.image, fresh.image)
            pv = patchify_normalise(pre.image, values)
            assert np.shares_memory(pv, values) and pv.shape == fresh.pixel_values.shape
            assert np.array_equal(pv.view(np.uint32), fresh.pixel_values.view(np.uint32))
        with patches.take(plan.pixel_values_size) as values:  # the same buffer, holding this image's patches
            values[:] = np.nan
            got_plan, pv = preprocess_patches(data, out=values)
            assert got_plan == plan and np.shares_memory(pv, values)
            assert np.array_equal(pv.view(np.uint32), fresh.pixel_values.view(np.uint32))


def test_output_buffers_that_do_not_fit_are_refused_before_decoding():
    data = png(56, 56, seed=4)
    with pytest.raises(ValueError, match="out holds 9407 values; this image needs 9408"):
        preprocess_image(data[:200], out=np.empty(56 * 56 * 3 - 1, np.uint8))  # truncated: refused first
    with pytest.raises(ValueError, match="writable C-contiguous uint8"):
        preprocess_image(data, out=np.empty(56 * 56 * 3, np.float32))
    with pytest.raises(ValueError, match="out holds 100 values"):
        patchify_normalise(preprocess_image(data).image, np.empty(100, np.float32))
    with pytest.raises(ValueError, match="out holds 9407 values; this image needs 9408"):
        preprocess_patches(data[:200], out=np.empty(16 * 588 - 1, np.float32))  # truncated: refused first


def test_buffer_pool_reuses_touched_buffers_and_keeps_a_bounded_number():
    pool = BufferPool(np.float32, keep=1)
    with pool.take(1000) as a:
        a[:] = 1
    with pool.take(10) as b:  # smaller: the same, already touched, buffer
        assert b.size == 10 and np.shares_memory(a, b)
    with pool.take(2000) as c:  # larger: a new one, which replaces the old
        assert not np.shares_memory(a, c)
    with pool.take(1500) as d:
        assert np.shares_memory(c, d)
    two = BufferPool(np.uint8, keep=2)
    with two.take(10) as x, two.take(20) as y:  # taken at once: two buffers
        assert not np.shares_memory(x, y)
    with two.take(5) as x2, two.take(15) as y2:
        assert np.shares_memory(x, x2) and np.shares_memory(y, y2)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        BufferPool(np.uint8, keep=0)
