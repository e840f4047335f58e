"""PerTh's trained network, loaded from the ``resemble-perth`` package without its wrappers.

``perth`` 1.0.1 ships its encoder and decoder (``perth.perth_net.perth_net_implicit.model``),
their hyperparameters and the trained checkpoint (``perth/perth_net/pretrained/implicit``),
but ``perth/perth_net/__init__.py`` imports its watermarker wrapper, which imports librosa
(resampling), and the ``PerthNet`` module imports torchaudio (its STFT). Neither belongs in
the codec worker (torchaudio has no build for our torch and breaks ``import vllm``). So the
package ``perth.perth_net`` is registered here without running its ``__init__``, and the
model modules, which import only torch, are imported from the installed package as they are.
The STFT the wrapper took from torchaudio is ``codec_worker.watermark.spectral``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

PERTH_VERSION = "1.0.1"
RUN_NAME = "implicit"
"""The pretrained run the package ships (the one ``PerthImplicitWatermarker`` loads)."""


class WatermarkUnavailable(RuntimeError):
    """The configured watermark cannot be loaded (a permanent start-up failure: the
    orchestrator's ``classify`` matches this name)."""


class PerthParts(NamedTuple):
    encoder: nn.Module
    """``Encoder``: normalised magnitude spectrogram ``(B, 1025, T)`` -> marked, mask."""
    decoder: nn.Module
    """``Decoder``: normalised magnitude spectrogram ``(B, 1025, T)`` -> score ``(B,)``."""
    hp: Any
    """``PerthConfig``: sample rate 32 kHz, n_fft 2048, hop 320, hann, magnitude floor 1e-9."""
    subband: int
    """Bins the network reads and marks (below ``max_wmark_freq``, 2 kHz: 128)."""
    step: int
    magmask: Callable[[torch.Tensor], torch.Tensor]
    """PerTh's frame mask (``model.magmask``): frames above 5% of the loudest one's energy."""


def _package_dir() -> Path:
    spec = importlib.util.find_spec("perth")
    if spec is None or not spec.submodule_search_locations:
        raise WatermarkUnavailable(
            f"the PerTh watermark needs the resemble-perth=={PERTH_VERSION} package"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _model_modules(root: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    name = "perth.perth_net"
    existing = sys.modules.get(name)
    if existing is None:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / "perth_net")]
        pkg.__package__ = name
        sys.modules[name] = pkg
    base = "perth.perth_net.perth_net_implicit"
    return (
        importlib.import_module(f"{base}.model"),
        importlib.import_module(f"{base}.model.encoder"),
        importlib.import_module(f"{base}.model.decoder"),
    )


def load_perth(device: torch.device | str = "cpu") -> PerthParts:
    """The package's own Encoder and Decoder with the shipped checkpoint, in eval mode."""
    try:
        root = _package_dir()
        model, enc_mod, dec_mod = _model_modules(root)
        ckpt_mgr = importlib.import_module("perth.perth_net.perth_net_implicit.checkpoint_manager")
        models_dir = root / "perth_net" / "pretrained"
        if not (models_dir / RUN_NAME / "hparams.yaml").is_file():
            raise FileNotFoundError(f"no PerTh checkpoint under {models_dir / RUN_NAME}")
        manager = ckpt_mgr.CheckpointManager(str(models_dir), RUN_NAME)
        hp = manager.hp
        ckpt = manager.load_latest()
        if ckpt is None:
            raise FileNotFoundError(f"no PerTh checkpoint file under {models_dir / RUN_NAME}")
        subband = model.compute_subband_freq(hp)
        encoder = enc_mod.Encoder(hp.hidden_size, subband)
        decoder = dec_mod.Decoder(hp.hidden_size, subband)
        state = ckpt["model"]
        for prefix, module in (("encoder.", encoder), ("decoder.", decoder)):
            part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            module.load_state_dict(part)
    except WatermarkUnavailable:
        raise
    except Exception as e:  # whatever it was, the server must not start unmarked
        raise WatermarkUnavailable(f"PerTh watermark unloadable: {type(e).__name__}: {e}") from e
    encoder.to(device).eval().requires_grad_(False)
    decoder.to(device).eval().requires_grad_(False)
    step = int(ckpt.get("step", 0))
    return PerthParts(encoder, decoder, hp, int(subband), step, model.magmask)
