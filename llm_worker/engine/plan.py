"""How the engine is built: its model runner, its output head and its logits processors,
chosen together before the engine exists (each choice depends on the one before).

1. The model runner (``llm.model_runner``, :mod:`llm_worker.vllm_ext.sampling.runner`), pinned into
   ``VLLM_USE_V2_MODEL_RUNNER`` (the engine core inherits it).
2. The sampling processors for that runner (:mod:`llm_worker.engine.sampling_setup`: repetition
   penalty, audio-token constraint, their prevented-token board).
3. The output head (``llm.output_head``, :mod:`llm_worker.engine.output_head`): the audio head needs
   our tensor penalty on the V1 runner.

The engine's arguments are built from the plan (:func:`llm_worker.engine.args.
prepare_engine_args`); :class:`llm_worker.engine.engine.GenerationEngine` is started from them and
confirms vLLM ran the runner the plan was made for (:meth:`EnginePlan.check_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config.llm import LLMConfig
from llm_worker.engine.output_head import HeadChoice, choose_output_head
from llm_worker.engine.sampling_setup import SamplingSetup, setup_sampling


@dataclass
class EnginePlan:
    runner: Any
    """The ``ModelRunner`` pinned for the engine (None: not pinned, vLLM's own choice)."""
    head: HeadChoice
    sampling: SamplingSetup

    @property
    def logits_processors(self) -> list[type]:
        return self.sampling.logits_processors

    def check_runner(self, vllm_config: Any) -> None:
        """The processors were chosen before the engine existed: confirm vLLM agrees."""
        if self.runner is None:
            return
        from llm_worker.vllm_ext.sampling import detect_model_runner

        actual = detect_model_runner(vllm_config)
        if actual != self.runner:
            raise RuntimeError(
                f"sampling was set up for model runner {self.runner} but vLLM runs {actual} "
                "(VLLM_USE_V2_MODEL_RUNNER was pinned: an unsupported combination?)"
            )

    def close(self) -> None:
        self.sampling.close()


def plan_engine(config: LLMConfig, board_name: str, device: str) -> EnginePlan:
    """Choose and pin the model runner, then the processors and the head that go with it.

    Raises ValueError for a configuration this vLLM cannot run (one line, no traceback
    needed), and ImportError if a processor module the plan needs does not import: both
    are permanent, so they are not hidden behind a fallback.
    """
    from llm_worker.vllm_ext.sampling import ModelRunner, choose_model_runner, pin_model_runner

    choice = choose_model_runner(config.model_runner, device)
    pin_model_runner(choice.runner)
    sampling = setup_sampling(config, choice.runner, board_name, v2_processors=choice.v2_processors)
    sampling.description = f"{sampling.description} [runner: {choice.reason}]"
    try:
        head = choose_output_head(
            config.output_head,
            config.model,
            v1_runner=choice.runner is ModelRunner.V1,
            tensor_penalty=sampling.tensor_penalty,
        )
    except BaseException:
        sampling.close()
        raise
    return EnginePlan(runner=choice.runner, head=head, sampling=sampling)
