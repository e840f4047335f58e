"""Deterministic decoder noise: a function of (stream seed, noise block, absolute position).

SNAC's NoiseBlocks add ``randn * linear(x)`` with fresh noise on every call, so two decodes of
overlapping windows disagree wherever they overlap and a streamed utterance never matches an
offline decode. Here the noise sample at a block's absolute time index is a hash of that index
and the stream's seed, so every window that covers a position draws the same value there.

The hash is integer arithmetic on int64 tensors kept below 2**63 (32-bit state, a 27-bit
multiplier), so it is exact on every backend and traceable by torch.compile. Two 24-bit
uniforms make one Gaussian (Box-Muller).
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x045D9F3B  # 27 bits: a 32-bit value times this stays below 2**59
_STREAM_U1 = 0x2545F491
_STREAM_U2 = 0x5BD1E995
_BLOCK_SALT = 0x9E3779B9
_INV_2_24 = 1.0 / (1 << 24)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    return (x >> 16) ^ x


def mix32_int(x: int) -> int:
    """``mix32`` of one Python int (for seeds computed on the host)."""
    x &= _MASK32
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    return (x >> 16) ^ x


def decode_seed(noise_seed: int) -> int:
    """The noise seed the codec worker gives every stream.

    Noise depends on (configured seed, absolute position) only, not on the stream id, so the
    same codes decode to the same audio in any stream: a request with a ``seed`` is
    reproducible end to end, and overlapping windows still agree at every seam.
    """
    return stream_seed(noise_seed, 0)


def stream_seed(noise_seed: int, stream_id: int) -> int:
    """A stream's 32-bit noise seed from the configured seed and the stream id."""
    return mix32_int(mix32_int(noise_seed) ^ mix32_int(stream_id) ^ (stream_id >> 32))


def block_seeds(seeds: torch.Tensor, block: int) -> torch.Tensor:
    """Per-row seeds ``(B,)`` salted for one noise block (blocks draw independent noise)."""
    return mix32(seeds ^ ((_BLOCK_SALT * (block + 1)) & _MASK32))


def positional_noise(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Standard normal noise ``(B, T)`` float32 for absolute ``positions (B, T)`` (int64).

    ``seeds`` are ``(B,)`` int64 in [0, 2**32), already salted with ``block_seeds``.
    """
    key = mix32((positions & _MASK32) ^ seeds[:, None])
    h1 = mix32(key ^ _STREAM_U1)
    h2 = mix32(key ^ _STREAM_U2)
    u1 = ((h1 >> 8).to(torch.float32) + 0.5) * _INV_2_24  # (0, 1): log is finite
    u2 = (h2 >> 8).to(torch.float32) * _INV_2_24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
