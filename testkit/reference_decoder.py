"""The reference streaming decoder (Orpheus-TTS's own), reproduced for comparison.

After 4 frames, and then after every frame, it decodes the stream's last 4 frames in one
``SNAC.decode`` call of its own (batch 1, fresh decoder noise) and emits samples 2048..4095,
the second frame of the window. Frame 0 and the last two frames are never emitted.
"""

from __future__ import annotations

import numpy as np
import torch
from snac import SNAC

WINDOW_FRAMES = 4
EMITTED_FRAME = 1
"""Index of the emitted frame inside the window."""
FIRST_CHUNK_FRAMES = 4


def reference_chunk(model: SNAC, window: np.ndarray, device: torch.device) -> bytes:
    """One call of the reference: ``(4, 7)`` frames -> the second frame's int16 PCM bytes."""
    # As the reference does it: build the three code tensors from the frame's slots per call.
    codes_0 = torch.tensor(window[:, 0], dtype=torch.int32, device=device)
    codes_1 = torch.tensor(window[:, [1, 4]].reshape(-1), dtype=torch.int32, device=device)
    codes_2 = torch.tensor(window[:, [2, 3, 5, 6]].reshape(-1), dtype=torch.int32, device=device)
    codes = [codes_0.unsqueeze(0), codes_1.unsqueeze(0), codes_2.unsqueeze(0)]
    if any(torch.any(c < 0) or torch.any(c > 4096) for c in codes):
        return b""
    with torch.inference_mode():
        audio_hat = model.decode(codes)
    audio_slice = audio_hat[:, :, 2048:4096]
    audio_np = audio_slice.detach().cpu().numpy()
    return (audio_np * 32767).astype(np.int16).tobytes()


def reference_stream(model: SNAC, frames: np.ndarray, device: torch.device) -> list[bytes]:
    """All chunks the reference emits for one utterance of ``(n, 7)`` frames."""
    return [
        reference_chunk(model, frames[f - WINDOW_FRAMES + 1 : f + 1], device)
        for f in range(WINDOW_FRAMES - 1, frames.shape[0])
    ]


def reference_emitted_frames(n: int) -> range:
    """Frames of an ``n``-frame utterance that the reference emits, in order."""
    return range(EMITTED_FRAME, max(EMITTED_FRAME, n - WINDOW_FRAMES + 1 + EMITTED_FRAME))
