"""The reference package's streaming decoder (``orpheus_tts.decoder.tokens_decoder``).

Per request: audio tokens are turned into codes by their position, appended to a
buffer, and once 28 have been collected, and then after every 7 more, the last 28 codes
(4 frames) are decoded by their own SNAC call; samples 2048..4095 of the 8192 decoded
(the window's second frame) are emitted as int16 PCM. So every frame is decoded four
times, the first audio waits for 4 frames, and the first frame and the last two frames
of an utterance are never emitted: that is the reference's design, kept here.

Departures from the package, all in the baseline's favour or neutral:

- It reads token ids from vLLM instead of parsing ``<custom_token_N>`` out of the
  cumulative detokenized text (same codes, no detokenizer, no string work).
- It builds the three code tensors with one vectorised reshape instead of ~50 tiny
  ``torch.cat`` calls per window.
- Its validity check is ``0 <= code < 4096`` (the package's ``> 4096`` lets code 4096
  through to an out-of-range embedding lookup).
- The package keeps only codes ``> 0``: code 0, which is valid, is dropped without
  advancing the position, and every later token is then read in the wrong slot (users
  report skipped frames and garbled audio). By default this implementation keeps code 0
  (``keep_zero_filter_bug=False``): with the bug the baseline would lose windows through
  a correctness error rather than its design, which would flatter our ratio.
"""

from __future__ import annotations

import numpy as np
import torch

from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE, FRAME_CODES

WINDOW_CODES = 28
"""4 frames of 7 codes: the reference decodes this many on each call."""
EMIT_START, EMIT_END = 2048, 4096
"""Samples of the decoded window that are emitted: its second frame."""


def window_to_levels(codes: list[int], device: torch.device) -> list[torch.Tensor]:
    """4 frames of Orpheus slot-ordered codes -> SNAC's levels (1, 4), (1, 8), (1, 16)."""
    frames = np.asarray(codes, dtype=np.int64).reshape(-1, FRAME_CODES)
    l0 = frames[:, 0]
    l1 = frames[:, [1, 4]].reshape(-1)
    l2 = frames[:, [2, 3, 5, 6]].reshape(-1)
    return [torch.from_numpy(level).to(device).unsqueeze(0) for level in (l0, l1, l2)]


class ReferenceStreamDecoder:
    """State of one request's stream: the code buffer and the position counter."""

    def __init__(
        self, snac: torch.nn.Module, device: torch.device, *, keep_zero_filter_bug: bool = False
    ) -> None:
        self._snac = snac
        self._device = device
        self._min_code = 1 if keep_zero_filter_bug else 0
        self._buffer: list[int] = []
        self.count = 0
        """Audio codes accepted so far (the reference's ``count``)."""
        self.windows_decoded = 0
        self.windows_dropped = 0

    def push(self, token_id: int) -> bytes | None:
        """Feed one generated token; returns the PCM of a window when one is due."""
        if token_id < T.CUSTOM_TOKEN_BASE:
            return None  # not a <custom_token_N>: the reference skips it without counting
        code = token_id - T.AUDIO_TOKEN_BASE - (self.count % FRAME_CODES) * CODEBOOK_SIZE
        if code < self._min_code:
            return None  # not counted: later positions are read relative to this one
        self._buffer.append(code)
        self.count += 1
        if self.count % FRAME_CODES == 0 and self.count >= WINDOW_CODES:
            return self._decode(self._buffer[-WINDOW_CODES:])
        return None

    def _decode(self, window: list[int]) -> bytes | None:
        if min(window) < 0 or max(window) >= CODEBOOK_SIZE:
            self.windows_dropped += 1
            return None  # the reference returns nothing for a window with a bad code
        levels = window_to_levels(window, self._device)
        with torch.inference_mode():
            audio = self._snac.decode(levels)
        self.windows_decoded += 1
        chunk = audio[0, 0, EMIT_START:EMIT_END].detach().cpu().numpy()
        return (chunk * 32767).astype(np.int16).tobytes()
