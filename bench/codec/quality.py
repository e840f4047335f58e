"""Audio quality check that needs no trained weights (``bench codec`` and the codec tests):
streamed chunks against one offline decode of the same codes (docs/orpheus.md). Clicks and
disagreements at seams show up as error energy; the result is the error's energy relative to
the signal's, in dB (lower is better)."""

from __future__ import annotations

import math

import numpy as np


def error_db(streamed: np.ndarray, offline: np.ndarray) -> float:
    """``10 log10(|streamed - offline|^2 / |offline|^2)`` over equal-length sample arrays."""
    a = np.asarray(streamed, dtype=np.float64)
    b = np.asarray(offline, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"streamed {a.shape} and offline {b.shape} audio differ in length")
    signal = float(np.sum(b * b))
    error = float(np.sum((a - b) ** 2))
    if signal == 0.0:
        return -math.inf if error == 0.0 else math.inf
    return -math.inf if error == 0.0 else 10.0 * math.log10(error / signal)
