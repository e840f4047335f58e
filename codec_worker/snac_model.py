"""Loading the SNAC 24 kHz codec, and writing a random-weight one for tests and the demo.

A checkpoint is a directory (or an HF repository) with ``config.json`` and
``pytorch_model.bin``, the layout ``snac.SNAC.from_pretrained`` reads. Random weights give
the real architecture and cost but decode to noise, not speech.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from snac import SNAC
from torch import nn
from torch.nn.utils import parametrize

SNAC_24KHZ: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
"""The published ``hubertsiuzdak/snac_24khz`` configuration (the codec Orpheus emits codes for)."""

SNAC_24KHZ_SMALL: dict[str, Any] = {
    **SNAC_24KHZ,
    "encoder_dim": 8,
    "decoder_dim": 64,
}
"""Same frame layout, strides and receptive field with narrow channels: for tests that are not
about the codec's cost (a decode takes milliseconds instead of a large fraction of a second)."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"


class SnacConfigError(ValueError):
    """The checkpoint is not a SNAC that decodes Orpheus frames."""


class SnacCheckpointUnreadable(ValueError):
    """The weights file exists but is not a checkpoint torch can read. A damaged file makes
    torch's unpickler raise whatever its bytes lead it to (``UnpicklingError``, ``EOFError``,
    a ``KeyError`` of its memo, ...): one type here, so the failure is classified as
    permanent whichever it was."""


def check_orpheus_compatible(model: SNAC) -> None:
    """Orpheus frames (1 + 2 + 4 codes) need strides [4, 2, 1] and 2048 samples per frame."""
    if list(model.vq_strides) != [4, 2, 1]:
        raise SnacConfigError(f"SNAC vq_strides {model.vq_strides} are not [4, 2, 1]")
    hop = 1
    for r in model.decoder_rates:
        hop *= r
    if hop * model.vq_strides[0] != 2048:
        raise SnacConfigError(f"SNAC decodes {hop * 4} samples per frame, Orpheus needs 2048")
    if model.attn_window_size is not None:
        raise SnacConfigError("SNAC with local attention (attn_window_size) is not supported")


def fuse_weight_norm(model: nn.Module) -> nn.Module:
    """Replace weight-norm parametrizations by their current weights (inference only).

    SNAC's convolutions recompute ``g * v / |v|`` on every call otherwise: pure overhead for
    a frozen decoder, and one less thing for torch.compile to trace.
    """
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            weight = module.weight
            if not isinstance(weight, nn.Parameter):  # frozen originals come back as buffers
                delattr(module, "weight")
                module.weight = nn.Parameter(weight, requires_grad=False)
    return model


def _hub_file(repo: str, filename: str) -> str:
    """The cached copy when there is one (no network round trip), else a download."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo, filename)
    if isinstance(cached, str):
        return cached
    return hf_hub_download(repo_id=repo, filename=filename)


def _read_checkpoint(name_or_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        config_path = os.path.join(path, CONFIG_FILE)
        weights_path = os.path.join(path, WEIGHTS_FILE)
        for p in (config_path, weights_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"SNAC checkpoint {name_or_path!r} has no {p}")
    elif os.path.isabs(path) or path.startswith("."):
        raise FileNotFoundError(f"SNAC checkpoint directory {name_or_path!r} does not exist")
    else:  # an HF repository name
        config_path = _hub_file(name_or_path, CONFIG_FILE)
        weights_path = _hub_file(name_or_path, WEIGHTS_FILE)
    with open(config_path) as f:
        config = json.load(f)
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except (OSError, MemoryError):
        raise
    except Exception as e:
        raise SnacCheckpointUnreadable(f"{weights_path}: {type(e).__name__}: {e}") from e
    return config, state


def load_snac(name_or_path: str, device: torch.device | str = "cpu", *, fuse: bool = True) -> SNAC:
    """Load a SNAC checkpoint by HF name or local directory, in FP32 and eval mode.

    ``fuse`` folds the weight norms into plain weights (what the worker runs); ``fuse=False``
    keeps the modules exactly as ``SNAC.from_pretrained`` builds them (the reference path).
    """
    config, state = _read_checkpoint(name_or_path)
    model = SNAC(**config)
    model.load_state_dict(state)
    check_orpheus_compatible(model)
    model = model.float().eval().requires_grad_(False)
    if fuse:
        fuse_weight_norm(model)
    return model.to(device)
