"""Which vLLM model runner the engine runs, chosen by configuration and pinned before it starts.

vLLM has two model runners with different sampling internals (see :mod:`.plan`), and the
choice between them depends on the installed release:

- 0.25 (the GPU machine's): V2 is the default for Llama when Triton works, but *any* custom
  logits processor makes ``VllmConfig.use_v2_model_runner`` fall back to V1, and the V2
  processor interface (``vllm.v1.worker.gpu.sample.logits_processor.interface``) does not
  exist. So on 0.25 "V2" means vLLM's own device-resident penalty and **no** audio-token
  constraint (an invalid token then drops its frame, llm_worker/codes.py).
- 0.32 and later: the V2 runner takes processors written to that interface, so the
  constraint runs on V2 too.

``llm.model_runner`` (``auto``, ``v1``, ``v2``) decides; :func:`pin_model_runner` writes the
choice into ``VLLM_USE_V2_MODEL_RUNNER`` so that vLLM (this process and the engine core it
spawns) cannot decide otherwise, and the worker checks after start-up that it did not.

``auto``: V2 wherever it can run (a GPU build with Triton), else V1. Measured on an H100
with vLLM 0.25.1 (docs/performance.md, "V1 or V2 on the GPU"): V2 with vLLM's own penalty held
78 real-time streams, V1 with our tensor penalty and constraint 45. With any custom logits
processor V1 waits each step for the previous step's sampled tokens, which takes back what
async scheduling hides, and our processors' host work adds to the engine core's, the process
that bounds capacity. What V2 gives up on 0.25 is the constraint: a trained model's rare
invalid token then costs one dropped frame (85 ms), counted in
``orpheus_llm_frames_dropped_total{reason="invalid"}``.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

V2_PROCESSOR_INTERFACE = "vllm.v1.worker.gpu.sample.logits_processor.interface"
"""The V2 runner's logits-processor interface module (vLLM 0.32+; absent in 0.25)."""

RUNNER_CHOICES = ("auto", "v1", "v2")


class ModelRunner(enum.StrEnum):
    V1 = "v1"
    V2 = "v2"


@dataclass(frozen=True)
class RunnerChoice:
    runner: ModelRunner
    v2_processors: bool
    """Whether the installed vLLM's V2 runner takes custom logits processors."""
    reason: str


def v2_processors_supported() -> bool:
    """The installed vLLM has the V2 runner's logits-processor interface."""
    try:
        return importlib.util.find_spec(V2_PROCESSOR_INTERFACE) is not None
    except ModuleNotFoundError:  # a parent package is missing (vLLM 0.25: .../sample/...)
        return False


def v2_available(device: str) -> bool:
    """The V2 runner can run here: a GPU build of vLLM with working Triton."""
    if device == "cpu":
        return False
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def choose_model_runner(setting: str, device: str) -> RunnerChoice:
    """The runner for ``llm.model_runner = setting`` on ``device``; raises ValueError for a
    setting this vLLM cannot honour (so the worker fails at once, in one line)."""
    if setting not in RUNNER_CHOICES:
        raise ValueError(f"llm.model_runner must be one of {RUNNER_CHOICES}, not {setting!r}")
    procs = v2_processors_supported()
    if setting == "v2":
        if not v2_available(device):
            raise ValueError(
                "llm.model_runner = v2 needs vLLM's GPU build with Triton "
                f"(device {device}); use v1 or auto"
            )
        why = "configured" + (
            ""
            if procs
            else "; this vLLM's V2 runner takes no custom logits processors: audio-token constraint off"
        )
        return RunnerChoice(ModelRunner.V2, procs, why)
    if setting == "v1":
        return RunnerChoice(ModelRunner.V1, procs, "configured")
    if v2_available(device):
        why = "auto: V2 on the GPU (H100: 78 vs 45 streams for V1, docs/performance.md)"
        if not procs:
            why += "; this vLLM's V2 runner takes no custom logits processors: constraint off"
        return RunnerChoice(ModelRunner.V2, procs, why)
    return RunnerChoice(ModelRunner.V1, procs, "auto: V1 (V2 needs vLLM's GPU build with Triton)")


def pin_model_runner(runner: ModelRunner) -> None:
    """Make vLLM use ``runner`` (its ``VLLM_USE_V2_MODEL_RUNNER``; inherited by the engine
    core process). An explicit environment setting that disagrees is an error."""
    want = "1" if runner is ModelRunner.V2 else "0"
    have = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if have is not None and have.strip().lower() in ("0", "1", "true", "false"):
        forced = have.strip().lower() in ("1", "true")
        if forced != (runner is ModelRunner.V2):
            raise ValueError(
                f"VLLM_USE_V2_MODEL_RUNNER={have} in the environment contradicts "
                f"llm.model_runner ({runner}); set one of them"
            )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = want


def prepare_sampler_environment() -> str | None:
    """Turn off vLLM's FlashInfer top-p/top-k sampler where FlashInfer is not installed.

    vLLM 0.25's GPU samplers (V1 and V2) call ``flashinfer_sampler_supported()``, which
    imports vLLM's FlashInfer attention backend and with it ``flashinfer``: without the
    package the engine core dies building its Sampler. ``VLLM_USE_FLASHINFER_SAMPLER=0``
    selects vLLM's PyTorch/Triton sampler instead. An explicit setting is left alone.
    Returns a line for the start-up log, or None when nothing was changed.
    """
    if "VLLM_USE_FLASHINFER_SAMPLER" in os.environ:
        return None
    if importlib.util.find_spec("flashinfer") is not None:
        return None
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return "flashinfer is not installed: vLLM's PyTorch/Triton top-p sampler (VLLM_USE_FLASHINFER_SAMPLER=0)"


def actual_model_runner(vllm_config: object) -> ModelRunner:
    """The runner vLLM decided on for a built engine."""
    return ModelRunner.V2 if getattr(vllm_config, "use_v2_model_runner", False) else ModelRunner.V1
