"""A worker's way to its device for padded uint8 images: one reused host buffer and a copy stream.

The worker builds each padded image straight into the staging buffer (`vision.preprocess_image(
out=)`), so the image is written once on the host and never copied there again. On a GPU the
buffer is pinned: the copy to the card is a DMA on the worker's own copy stream, not blocking the
host, and the compute stream waits for it on the device. So the copy of image k+1 runs while the
tower still works on image k. The buffer is written again only once its last copy has finished.
On a CPU device the staging buffer itself is the image the patchify reads (nothing is copied).
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Not thread-safe: one per worker."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._copied: torch.cuda.Event | None = None  # the last copy out of the buffer

    @property
    def capacity(self) -> int:
        """Bytes of the host buffer (it grows to the largest image seen, never shrinks)."""
        return self._host.numel()

    def buffer(self, nbytes: int) -> np.ndarray:
        """The buffer's first `nbytes`, writable, once the last copy out of it has finished. Grows
        (one new allocation, pinned on a GPU) only for an image larger than any before."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if nbytes > self._host.numel():
            self._host = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        return self._host[:nbytes].numpy()

    def upload(self, image: np.ndarray) -> torch.Tensor:
        """`image`, a view of `buffer()`, as a uint8 tensor on the device; on a GPU the copy is
        queued on the copy stream and the current stream waits for it (the host does not)."""
        if image.ctypes.data != self._host.data_ptr() or image.nbytes > self._host.numel():
            raise ValueError("upload takes the image built in this staging buffer")
        host = self._host[: image.nbytes].view(image.shape)
        if not self._cuda:
            return host
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            on_device = host.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        compute.wait_event(self._copied)
        # Allocated on the copy stream, used on the compute stream: its memory must not be reused
        # before the compute stream is done with it.
        on_device.record_stream(compute)
        return on_device
