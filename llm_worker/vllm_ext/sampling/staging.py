"""Small host vectors that a processor fills each step and the device reads.

``np`` is the processor's host-side state (plain memory, written at any time). ``upload(k)``
returns ``np[:k]`` as a device tensor.

On the CPU build the device tensor *is* the host tensor (no copy). On CUDA, ``np[:k]`` is
copied into one of :data:`PINNED_BUFFERS` pinned buffers and from there to the device with
``non_blocking=True``; an event recorded after each copy guards its pinned buffer. A pinned
buffer is refilled only once the copy that last read it has completed: without that, under
async scheduling (where the V1 runner does not wait for the previous step's sampled tokens
unless a row still holds a placeholder) a copy still queued on the stream could read a buffer
that the host is already overwriting for the next step. With two buffers the wait is for the
copy issued two uploads ago, which the stream has long finished in steady state, so it costs
an event query, not a stall.
"""

from __future__ import annotations

import numpy as np
import torch

PINNED_BUFFERS = 2


class Staged:
    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self._on_cpu = device.type == "cpu"
        host = torch.zeros(n, dtype=dtype)
        self.np: np.ndarray = host.numpy()
        if self._on_cpu:
            self.dev = host
            return
        self.dev = torch.zeros(n, dtype=dtype, device=device)
        self._pinned = [torch.zeros(n, dtype=dtype, pin_memory=True) for _ in range(PINNED_BUFFERS)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._copied: list[torch.cuda.Event | None] = [None] * PINNED_BUFFERS
        self._next = 0
        self.waits = 0
        """Uploads that found their pinned buffer's last copy still in flight (diagnostic)."""

    def upload(self, k: int) -> torch.Tensor:
        """``np[:k]`` as a device tensor."""
        if self._on_cpu:
            return self.dev[:k]
        i = self._next
        self._next = (i + 1) % PINNED_BUFFERS
        event = self._copied[i]
        if event is not None and not event.query():
            # The copy that last read this pinned buffer is still queued: refilling it now
            # would race with the DMA. Wait for that copy alone (not the whole device).
            self.waits += 1
            event.synchronize()
        np.copyto(self._pinned_np[i][:k], self.np[:k])
        dev = self.dev[:k]
        dev.copy_(self._pinned[i][:k], non_blocking=True)
        if event is None:
            event = self._copied[i] = torch.cuda.Event()
        event.record()
        return dev
