"""Host-to-device uploads of a step's small arrays through persistent pinned buffers.

A copy from pageable host memory may make the host wait (the driver stages it, and may
wait for the stream), and `Tensor.pin_memory()` allocates page-locked memory per call.
Either can hold the launching thread until the GPU has finished the step before: then
asynchronous scheduling overlaps nothing. `PinnedStaging` keeps `depth` page-locked buffers
and hands out slices of one buffer per step (a bump allocator). When a step begins, an
event marks the uploads queued from the buffer in use, and the next buffer is reused only
once its own event (from `depth - 1` steps ago) has passed, which it has long since, so
nothing waits in practice.

`host_array` hands out such a slice as a NumPy array for the caller to fill in place (the
engine gathers a step's guided masks straight into it); `upload` of that array then sends
it as it is: one host copy, not two.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64


class PinnedStaging:
    def __init__(self, device: torch.device, capacity_bytes: int = 16 << 20, depth: int = 3):
        self.device = device
        self.capacity = capacity_bytes
        self.buffers = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.index = 0
        self.offset = 0

    def begin_step(self) -> None:
        """Seal the current buffer's uploads with an event and move to the next buffer."""
        event = torch.cuda.Event()
        event.record()
        self.events[self.index] = event
        self.index = (self.index + 1) % len(self.buffers)
        pending = self.events[self.index]
        if pending is not None:
            pending.synchronize()
        self.offset = 0

    def host_array(self, shape: tuple[int, ...], dtype) -> np.ndarray | None:
        """A page-locked array of `shape` in the current buffer, for the caller to fill and
        then `upload` (without a copy) in this step; None when the buffer has no room."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = -(-self.offset // ALIGN) * ALIGN
        if start + nbytes > self.capacity:
            return None
        self.offset = start + nbytes
        return self.buffers[self.index][start : start + nbytes].numpy().view(dtype).reshape(shape)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """`array` as a device tensor (same dtype and shape), copied asynchronously on the
        current stream. The array may be reused by the caller at once, unless it came from
        `host_array` (then it is sent from where it is)."""
        source = torch.from_numpy(np.ascontiguousarray(array))
        nbytes = source.numel() * source.element_size()
        buffer = self.buffers[self.index]
        at = source.data_ptr() - buffer.data_ptr()
        if 0 <= at and at + nbytes <= self.capacity:  # a `host_array` of this step: already pinned
            host = buffer[at : at + nbytes].view(source.dtype).view(source.shape)
            return host.to(self.device, non_blocking=True)
        start = -(-self.offset // ALIGN) * ALIGN
        if start + nbytes > self.capacity:  # larger than a buffer's room: a one-off pinned copy
            return source.pin_memory().to(self.device, non_blocking=True)
        self.offset = start + nbytes
        host = self.buffers[self.index][start : start + nbytes].view(source.dtype).view(source.shape)
        host.copy_(source)
        return host.to(self.device, non_blocking=True)
