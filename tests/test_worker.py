"""A worker's vision path in this process (service.engine.worker.ImageEncoder): patches built on
the device through the staging buffer, or on the host into reused buffers, give the same rows as
`vision` directly, image after image of different sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from images import png

from service.engine.worker import ImageEncoder, resolve_patchify
from tests.conftest import REPO_ROOT
from vision import DEFAULT_LIMITS, DEFAULT_OPTIONS, ImageDecodeError, ImageOptions, plan_image, preprocess_image

pytestmark = pytest.mark.usefixtures("torch_one_thread")






def test_staging_buffer_is_reused_across_images_of_different_sizes(tiny_encoder):
    device = ImageEncoder(tiny_encoder, DEFAULT_LIMITS, "device")
    host = ImageEncoder(tiny_encoder, DEFAULT_LIMITS, "host")
    assert (device.patchify, host.patchify) == ("device", "host") and not device.asynchronous
    photo = (REPO_ROOT / "samples" / "photo.jpg").read_bytes()
    # The largest first, then smaller ones (stale bytes of the larger image stay in the buffer
    # beyond each), a transparent one (checkerboard), one resized by the options, the largest again.
    images = [(png(560, 420, seed=1), DEFAULT_OPTIONS), (png(30, 20, seed=2), DEFAULT_OPTIONS),
              (png(300, 150, seed=3, mode="RGBA"), DEFAULT_OPTIONS), (photo, ImageOptions(max_tokens=64)),
              (png(560, 420, seed=4), DEFAULT_OPTIONS)]
    largest = plan_image(images[0][0]).image_bytes
    for i, (data, options) in enumerate(images):
        plan = plan_image(data, options)
        rows = device.encode(data, options, plan)
        want = tiny_encoder.encode([preprocess_image(data, options)])[0]
        assert torch.equal(rows, want), i
        assert torch.equal(host.encode(data, options, plan), want), i
        assert device.staging.capacity == largest  # grown once, for the first image; never again
        if i == 0:
            address = device.staging.buffer(1).ctypes.data
        assert device.staging.buffer(1).ctypes.data == address
    # Bad input between good images: the image's own error, and the buffers serve on.
    truncated = photo[: len(photo) // 2]
    with pytest.raises(ImageDecodeError):
        device.launch(truncated, DEFAULT_OPTIONS, plan_image(truncated))
    small = images[1][0]
    assert torch.equal(device.encode(small, DEFAULT_OPTIONS, plan_image(small)),
                       tiny_encoder.encode([preprocess_image(small)])[0])


def test_upload_takes_only_the_image_built_in_its_buffer(tiny_encoder):
    staging = ImageEncoder(tiny_encoder, DEFAULT_LIMITS, "device").staging
    staging.buffer(28 * 28 * 3)
    with pytest.raises(ValueError, match="built in this staging buffer"):
        staging.upload(np.zeros((28, 28, 3), np.uint8))


def test_patchify_choice():
    assert resolve_patchify("auto", "cpu") == "host" and resolve_patchify("auto", "cuda:1") == "device"
    assert resolve_patchify("device", "cpu") == "device" and resolve_patchify("host", "cuda:0") == "host"
    with pytest.raises(ValueError, match="patchify must be one of"):
        resolve_patchify("gpu", "cpu")
