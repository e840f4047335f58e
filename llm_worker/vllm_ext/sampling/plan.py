"""Which sampling path the worker runs, decided once at startup.

vLLM 0.32 has two model runners with different sampling internals:

- **V1** (legacy ``GPUModelRunner``; the CPU build's ``CPUModelRunner``, and the GPU
  runner when V2 is unavailable or ``VLLM_USE_V2_MODEL_RUNNER=0``): the penalty path
  rebuilds output tokens from Python lists each step. We replace it with
  :class:`~llm_worker.vllm_ext.sampling.penalty.TensorRepetitionPenalty` and constrain audio
  tokens with :class:`~llm_worker.vllm_ext.sampling.constraint.AudioTokenConstraint`. Note that
  with *any* custom logits processor and async scheduling the V1 runner waits each step
  for the previous step's sampled tokens; async scheduling is off on the CPU build anyway.
- **V2** (GPU builds with Triton): penalty state already lives on the device per request
  slot, so requests use vLLM's own ``repetition_penalty``; the constraint is
  :class:`~llm_worker.vllm_ext.sampling.constraint_v2.AudioTokenConstraintV2` where the installed
  vLLM's V2 runner takes custom processors (0.32+), and off otherwise (0.25).

Which one runs is ``llm.model_runner`` (:mod:`.runner`), pinned before the engine starts.

Usage in the worker::

    choice = choose_model_runner(cfg.llm.model_runner, device)
    pin_model_runner(choice.runner)
    plan = SamplingPlan.for_config(cfg.llm, choice.runner, board=board.name,
                                   v2_processors=choice.v2_processors)
    engine_args = AsyncEngineArgs(..., logits_processors=plan.logits_processors())
    log.info("sampling: %s", plan.describe())
    params = SamplingParams(max_tokens=..., stop_token_ids=[T.END_OF_SPEECH],
                            **sampling_kwargs(voice_sampling, plan, counter))

:func:`sampling_kwargs` is the one place a request's sampling (``VoiceSampling``: the voice's
defaults with the request's overrides, checked against ``common.limits`` where the request
arrived) becomes ``SamplingParams`` keywords: the fields vLLM takes as they are, and the
repetition penalty on the path the plan runs (vLLM's own, or ours through ``extra_args``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.config.llm import LLMConfig, VoiceSampling
from llm_worker.vllm_ext.sampling.args import RequestArgs
from llm_worker.vllm_ext.sampling.counters import SINK, Counter
from llm_worker.vllm_ext.sampling.runner import ModelRunner, actual_model_runner

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PASSED_ON = tuple(f for f in VoiceSampling.__struct_fields__ if f != "repetition_penalty")
"""The sampling fields that are ``SamplingParams`` keywords as they are; the repetition
penalty's path is the plan's (:meth:`SamplingPlan.request_kwargs`)."""


def detect_model_runner(vllm_config: VllmConfig) -> ModelRunner:
    """The model runner vLLM decided on (``VllmConfig.use_v2_model_runner``)."""
    return actual_model_runner(vllm_config)


@dataclass(frozen=True)
class SamplingPlan:
    runner: ModelRunner
    tensor_penalty: bool
    """Our tensor penalty replaces vLLM's (V1 only: V2's own is already device-resident)."""
    constrain_audio: bool
    board: str | None = None
    """Shared-memory board for prevented-token counts (None: the constraint does not count)."""

    @classmethod
    def for_config(
        cls,
        config: LLMConfig,
        runner: ModelRunner,
        board: str | None = None,
        *,
        v2_processors: bool = True,
    ) -> SamplingPlan:
        """``v2_processors``: the installed vLLM's V2 runner takes custom logits processors
        (False on vLLM 0.25: the constraint is then off on V2)."""
        v2 = runner is ModelRunner.V2
        return cls(
            runner=runner,
            tensor_penalty=config.tensor_penalties and not v2,
            constrain_audio=config.constrain_audio_tokens and (v2_processors or not v2),
            board=board,
        )

    def logits_processors(self) -> list[type]:
        """Classes for the engine's ``logits_processors=`` argument.

        On V1 the penalty comes first, so the constraint counts on penalised logits.
        """
        if self.runner is ModelRunner.V2:
            if not self.constrain_audio:  # vLLM 0.25: its V2 runner takes no custom processor
                return []
            from llm_worker.vllm_ext.sampling.constraint_v2 import AudioTokenConstraintV2

            return [AudioTokenConstraintV2]
        from llm_worker.vllm_ext.sampling.constraint import AudioTokenConstraint
        from llm_worker.vllm_ext.sampling.penalty import TensorRepetitionPenalty

        procs: list[type] = []
        if self.tensor_penalty:
            procs.append(TensorRepetitionPenalty)
        if self.constrain_audio:
            procs.append(AudioTokenConstraint)
        return procs

    def request_kwargs(
        self,
        *,
        repetition_penalty: float,
        counter: Counter | None = None,
        constrain: bool = True,
    ) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments: ``repetition_penalty`` and ``extra_args``.

        The prompt of a constrained request must end with start-of-speech. ``constrain``
        can turn the constraint off for one request; it cannot turn it on when the
        plan has no constraint processor. Merge any other ``extra_args`` of the worker's
        into the returned dict (our key is ``"orpheus"``).
        """
        ours = self.tensor_penalty and repetition_penalty != 1.0
        constrain = constrain and self.constrain_audio
        counted = constrain and self.board is not None
        args = RequestArgs(
            repetition_penalty=repetition_penalty if ours else 1.0,
            constrain_audio=constrain,
            board=self.board if counted else None,
            slot=counter.slot if counted and counter is not None else SINK,
        )
        kwargs: dict[str, Any] = {"repetition_penalty": 1.0 if ours else repetition_penalty}
        if extra := args.to_extra_args():
            kwargs["extra_args"] = extra
        return kwargs

    def describe(self) -> str:
        """One line for the startup log."""
        if self.runner is ModelRunner.V2:
            runner = "model runner V2 (penalty state device-resident per request slot)"
            penalty = "vLLM built-in (V2 keeps penalty counts on the device)"
        else:
            runner = "model runner V1 (legacy: penalties rebuilt from Python lists each step)"
            penalty = (
                "orpheus tensor penalty (preallocated token history; vLLM's list path skipped)"
                if self.tensor_penalty
                else "vLLM built-in list path (tensor_penalties = false)"
            )
        if self.constrain_audio:
            where = f"board {self.board}" if self.board else "not counted"
            constraint = f"on ({self.runner.upper()} logits processor; prevented tokens: {where})"
        else:
            constraint = "off"
        return f"{runner}; repetition penalty: {penalty}; audio-token constraint: {constraint}"


def sampling_kwargs(
    sampling: VoiceSampling, plan: SamplingPlan | None = None, counter: Counter | None = None
) -> dict[str, Any]:
    """A request's ``SamplingParams`` keywords for ``sampling``: its fields, the repetition
    penalty applied where ``plan`` runs it and the constraint's arguments (``counter``: the
    stream's slot on the prevented-token board). ``plan`` None: vLLM's own penalty, no
    constraint. Built once per stream; each segment adds its length, seed and stop id."""
    kwargs: dict[str, Any] = {f: getattr(sampling, f) for f in PASSED_ON}
    if plan is None:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    else:
        kwargs |= plan.request_kwargs(
            repetition_penalty=sampling.repetition_penalty, counter=counter
        )
    return kwargs
