"""SNAC decoding of streaming windows: positional noise and receptive-field cropping.

``WindowDecoder`` runs the modules of a (weight-norm-fused) SNAC 24 kHz with two changes
that leave the decoded samples of the emitted frames as SNAC computes them:

- **Positional noise**: every NoiseBlock draws ``codec_worker.noise.positional_noise`` at the
  window's absolute sample positions instead of fresh ``randn``, so overlapping windows agree
  and a streamed utterance can be compared with an offline decode.
- **Cropping**: a window is ``context + hop + lookahead`` frames but only the ``hop`` frames in
  the middle are emitted. The context and lookahead matter only through the decoder's
  receptive field, which shrinks (in frames) as the time resolution grows: after the first
  upsampling block each later stage needs the emitted span plus a few hundredths of a frame.
  The plan for a window shape crops each stage boundary to what the rest of the network reads
  from it, computed from the modules' kernel sizes, dilations, strides and paddings. The
  emitted samples are the same as those of the uncropped window (the tests check it); the
  redundant compute of context and lookahead falls from ~100% to ~17% of a frame per frame.

Shapes: ``frames (B, W, 7)`` integer codes in Orpheus slot order, ``seeds (B,)`` and
``starts (B,)`` int64 (per-row noise seed and absolute frame index of the window's first
frame). Output ``(B, hop * 2048)`` float32 in [-1, 1].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d
from torch import nn
from torch.nn.utils import parametrize

from codec_worker.levels import frames_to_levels, slot_order
from codec_worker.noise import block_seeds, positional_noise
from codec_worker.snac_model import check_orpheus_compatible

Range = tuple[int, int]


class WindowKey(NamedTuple):
    """A window's shape: frames before, emitted, and after. Windows of one key batch together."""

    context: int
    hop: int
    lookahead: int

    @property
    def frames(self) -> int:
        return self.context + self.hop + self.lookahead


class WindowPlan(NamedTuple):
    """Static slicing of one window shape (Python ints: torch.compile specialises on them)."""

    frames: int
    crops: tuple[Range, ...]
    """Local slice kept at each stage boundary: after the input convs, then after each block."""
    noise_offsets: tuple[int, ...]
    """Window-relative index of the first sample each block's noise is drawn for."""
    out: Range
    """Local slice of the final output that holds the emitted frames."""


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """snac.layers.snake, ``x + sin(alpha x)^2 / (alpha + 1e-9)``: the same operations in the
    same order (bit-identical), in place on one new tensor instead of four (on CPU the
    allocations cost as much as the arithmetic; torch.compile fuses either form)."""
    y = torch.mul(x, alpha).sin_().square_()
    return y.mul_((alpha + 1e-9).reciprocal()).add_(x)


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _conv_input_range(conv: nn.Conv1d, r: Range) -> Range:
    """Input samples a stride-1 'same' Conv1d reads to produce outputs ``r``."""
    (k,), (d,), (p,) = conv.kernel_size, conv.dilation, conv.padding  # type: ignore[misc]
    return r[0] - p, r[1] - p + d * (k - 1)


def _conv_transpose_input_range(conv: nn.ConvTranspose1d, r: Range) -> Range:
    """Input samples a ConvTranspose1d reads to produce outputs ``r``.

    ``y[j] = sum_i x[i] * w[j + p - i*s]`` for ``0 <= j + p - i*s < K``.
    """
    (k,), (s,), (p,) = conv.kernel_size, conv.stride, conv.padding  # type: ignore[misc]
    return _ceil_div(r[0] + p - k + 1, s), (r[1] - 1 + p) // s + 1


def _clip(r: Range, length: int) -> Range:
    return max(0, r[0]), min(length, r[1])


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"unsupported SNAC decoder layout: {what}")


def _is_same_conv(conv: nn.Module) -> bool:
    """A stride-1 Conv1d whose output is as long as its input (what the crop plan assumes)."""
    if not isinstance(conv, nn.Conv1d):
        return False
    (k,), (d,), (p,), (s,) = conv.kernel_size, conv.dilation, conv.padding, conv.stride  # type: ignore[misc]
    return s == 1 and 2 * p == d * (k - 1)


class _Residual(nn.Module):
    def __init__(self, unit: ResidualUnit) -> None:
        super().__init__()
        snake1, conv1, snake2, conv2 = unit.block
        _expect(isinstance(snake1, Snake1d) and isinstance(snake2, Snake1d), "residual unit")
        _expect(_is_same_conv(conv1) and _is_same_conv(conv2), "residual convolutions")
        self.alpha1, self.conv1, self.alpha2, self.conv2 = snake1.alpha, conv1, snake2.alpha, conv2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(_snake(self.conv1(_snake(x, self.alpha1)), self.alpha2))
        return y.add_(x)

    def input_range(self, r: Range) -> Range:
        return _conv_input_range(self.conv1, _conv_input_range(self.conv2, r))


class _Block(nn.Module):
    def __init__(self, block: DecoderBlock) -> None:
        super().__init__()
        layers = list(block.block)
        snake, conv_t = layers[0], layers[1]
        _expect(isinstance(snake, Snake1d), "decoder block activation")
        _expect(isinstance(conv_t, nn.ConvTranspose1d), "decoder block upsampling")
        assert isinstance(conv_t, nn.ConvTranspose1d)
        self.alpha, self.conv_t = snake.alpha, conv_t
        noise = [m for m in layers if isinstance(m, NoiseBlock)]
        self.noise_linear: nn.Conv1d | None = noise[0].linear if noise else None
        self.residuals = nn.ModuleList(_Residual(m) for m in layers if isinstance(m, ResidualUnit))
        (self.stride,) = conv_t.stride  # type: ignore[misc]
        # Output length is (L - 1) * s - 2p + k + output_padding: the plan needs exactly L * s.
        grow = conv_t.kernel_size[0] - 2 * conv_t.padding[0] + conv_t.output_padding[0]  # type: ignore[operator]
        _expect(grow == self.stride and conv_t.dilation[0] == 1, "upsampling by its stride")

    def forward(
        self, x: torch.Tensor, seeds: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.conv_t(_snake(x, self.alpha))
        if self.noise_linear is not None:
            assert seeds is not None and positions is not None
            h = self.noise_linear(x)
            x = h.mul_(positional_noise(seeds, positions)[:, None, :]).add_(x)
        for res in self.residuals:
            x = res(x)
        return x

    def input_range(self, r: Range, out_len: int) -> Range:
        for res in reversed(self.residuals):
            r = _clip(res.input_range(r), out_len)
        return _conv_transpose_input_range(self.conv_t, r)


class WindowDecoder(nn.Module):
    """Decodes batches of same-shape windows of Orpheus frames with a SNAC 24 kHz."""

    def __init__(self, snac: SNAC) -> None:
        super().__init__()
        check_orpheus_compatible(snac)
        if any(parametrize.is_parametrized(m) for m in snac.modules()):
            raise ValueError("fuse SNAC's weight norms first (codec_worker.snac_model.load_snac)")
        q = snac.quantizer.quantizers
        with torch.no_grad():
            # out_proj(codebook[c]) for every code: the quantizer's decode becomes a lookup.
            tables = [vq.out_proj(vq.codebook.weight.t()[None])[0].t().contiguous() for vq in q]
        self.register_buffer("table0", tables[0], persistent=False)
        self.register_buffer("table1", tables[1], persistent=False)
        self.register_buffer("table2", tables[2], persistent=False)
        self.register_buffer("slots", slot_order(), persistent=False)
        layers = list(snac.decoder.model)
        first_block = next(i for i, m in enumerate(layers) if isinstance(m, DecoderBlock))
        self.pre = nn.ModuleList(layers[:first_block])
        _expect(all(_is_same_conv(m) for m in self.pre), "input convolutions")
        self.blocks = nn.ModuleList(_Block(m) for m in layers if isinstance(m, DecoderBlock))
        snake, self.out_conv, tanh = layers[-3:]
        _expect(isinstance(snake, Snake1d) and isinstance(tanh, nn.Tanh), "output layers")
        _expect(_is_same_conv(self.out_conv), "output convolution")
        self.out_alpha = snake.alpha
        self.latent_per_frame = int(snac.vq_strides[0])
        rates = [self.latent_per_frame]
        for b in self.blocks:
            rates.append(rates[-1] * b.stride)
        self.rates: tuple[int, ...] = tuple(rates)
        """Samples per frame at each stage boundary (latent, then after each block)."""
        self.samples_per_frame = rates[-1]
        self._plans: dict[tuple[WindowKey, bool], WindowPlan] = {}

    # -- planning ----------------------------------------------------------------------------
    def plan(self, key: WindowKey, crop: bool = True) -> WindowPlan:
        """Slices for one window shape (cached). ``crop=False`` keeps every stage whole."""
        cached = self._plans.get((key, crop))
        if cached is not None:
            return cached
        c, h, w = key.context, key.hop, key.frames
        if h < 1 or c < 0 or key.lookahead < 0:
            raise ValueError(f"bad window shape {key}")
        rates, n = self.rates, len(self.blocks)
        emit = (c * rates[-1], (c + h) * rates[-1])
        # Backward: what each stage boundary must provide for the emitted span.
        need: list[Range] = [(0, 0)] * (n + 1)
        need[n] = _clip(_conv_input_range(self.out_conv, emit), w * rates[n])
        for i in range(n - 1, -1, -1):
            need[i] = _clip(self.blocks[i].input_range(need[i + 1], w * rates[i + 1]), w * rates[i])
        if not crop:
            need = [(0, w * r) for r in rates]
        # Forward: where each cropped tensor starts, in window-relative samples.
        crops: list[Range] = []
        noise_offsets: list[int] = []
        off, end = 0, w * rates[0]
        for i in range(n + 1):
            lo, hi = need[i]
            if lo < off or hi > end:
                raise RuntimeError(
                    f"crop plan for {key}: stage {i} needs {need[i]}, has {off, end}"
                )
            crops.append((lo - off, hi - off))
            off, end = lo, hi
            if i < n:
                s = self.blocks[i].stride
                off, end = off * s, end * s
                noise_offsets.append(off)
        plan = WindowPlan(w, tuple(crops), tuple(noise_offsets), (emit[0] - off, emit[1] - off))
        self._plans[(key, crop)] = plan
        return plan

    # -- decoding ----------------------------------------------------------------------------
    def latent(self, frames: torch.Tensor) -> torch.Tensor:
        """``(B, W, 7)`` frames -> SNAC latent ``(B, D, 4W)`` (the quantizer's ``from_codes``)."""
        l0, l1, l2 = frames_to_levels(frames, self.slots)
        b, w = l0.shape
        d = self.table0.shape[1]
        # Level k repeats each code over 4 / 2**k latent steps: broadcast instead of repeat.
        z = self.table0[l0].view(b, w, 1, 1, d) + self.table1[l1].view(b, w, 2, 1, d)
        z = z + self.table2[l2].view(b, w, 2, 2, d)
        return z.view(b, 4 * w, d).transpose(1, 2)

    def forward(
        self, frames: torch.Tensor, seeds: torch.Tensor, starts: torch.Tensor, plan: WindowPlan
    ) -> torch.Tensor:
        x = self.latent(frames)
        for conv in self.pre:
            x = conv(x)
        lo, hi = plan.crops[0]
        x = x[..., lo:hi]
        for i, block in enumerate(self.blocks):
            positions = salted = None
            if block.noise_linear is not None:
                t = x.shape[-1] * block.stride
                base = starts * self.rates[i + 1] + plan.noise_offsets[i]
                positions = base[:, None] + torch.arange(t, device=x.device)
                salted = block_seeds(seeds, i)
            x = block(x, salted, positions)
            lo, hi = plan.crops[i + 1]
            x = x[..., lo:hi]
        x = self.out_conv(_snake(x, self.out_alpha)).tanh_()
        return x[:, 0, plan.out[0] : plan.out[1]]

    def decode(
        self,
        frames: torch.Tensor,
        seeds: torch.Tensor,
        starts: torch.Tensor,
        key: WindowKey,
        crop: bool = True,
    ) -> torch.Tensor:
        """Decode windows of shape ``key``: the emitted ``(B, hop * 2048)`` samples."""
        if frames.shape[1] != key.frames:
            raise ValueError(f"windows of {frames.shape[1]} frames do not match {key}")
        return self.forward(frames, seeds, starts, self.plan(key, crop))

    def decode_offline(self, frames: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """One decode of whole utterances ``(B, n, 7)`` from frame 0 (the seam reference)."""
        n = frames.shape[1]
        starts = torch.zeros(frames.shape[0], dtype=torch.int64, device=frames.device)
        return self.decode(frames, seeds, starts, WindowKey(0, n, 0))
