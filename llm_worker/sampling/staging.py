"""Small host vectors that a processor fills each step and the device reads.

On the CPU build the device tensor *is* the host tensor (no copy). On CUDA the host side
is pinned and copied with ``non_blocking=True``. Reusing the pinned buffer next step is
safe on the V1 runner: before a step's logits processors run, the runner has waited for
the previous step's sampled tokens, which the stream produced after this copy.
"""

from __future__ import annotations

import numpy as np
import torch


class Staged:
    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        self.host = torch.zeros(n, dtype=dtype, pin_memory=not on_cpu)
        self.np: np.ndarray = self.host.numpy()
        self.dev = self.host if on_cpu else torch.zeros(n, dtype=dtype, device=device)

    def upload(self, k: int) -> torch.Tensor:
        """``host[:k]`` as a device tensor."""
        if self.dev is self.host:
            return self.host[:k]
        dev = self.dev[:k]
        dev.copy_(self.host[:k], non_blocking=True)
        return dev
