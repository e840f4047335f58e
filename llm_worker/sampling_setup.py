"""Wiring of the sampling package (:mod:`llm_worker.sampling`) into the worker.

The package supplies the logits processors (tensor repetition penalty on the legacy model
runner, audio-token constraint) and the per-request arguments that switch them on. This
module pins the model runner that ``llm.model_runner`` chooses, creates the prevented-token
board, picks the processors for that runner and the output head (``llm.output_head``,
:mod:`llm_worker.output_head`: which one depends on the runner and the penalty), and gives
the service the per-stream side (:class:`llm_worker.sampling.hooks.PlanHooks`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from common.llm_config import LLMConfig
from llm_worker.output_head import HeadChoice, choose_output_head
from llm_worker.sampling.hooks import PlanHooks, SamplingHooks
from shm.ring import segment_path

log = logging.getLogger(__name__)

BOARD_SPARE_SLOTS = 64
"""Board slots beyond max_num_seqs: streams waiting for their next segment hold one too."""


@dataclass
class SamplingSetup:
    hooks: SamplingHooks
    logits_processors: list[type]
    description: str
    head: HeadChoice
    runner: Any = None
    board: Any = None

    def total_prevented(self) -> int:
        return self.board.total() if self.board is not None else 0

    def check_runner(self, vllm_config: Any) -> None:
        """The processors were chosen before the engine existed: confirm vLLM agrees."""
        if self.runner is None:
            return
        from llm_worker.sampling import detect_model_runner

        actual = detect_model_runner(vllm_config)
        if actual != self.runner:
            raise RuntimeError(
                f"sampling was set up for model runner {self.runner} but vLLM runs {actual} "
                "(VLLM_USE_V2_MODEL_RUNNER was pinned: an unsupported combination?)"
            )

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


def setup_sampling(config: LLMConfig, board_name: str, device: str) -> SamplingSetup:
    """Choose and pin the model runner (``llm.model_runner``), then build what it needs.

    Raises ValueError for a configuration this vLLM cannot run (one line, no traceback
    needed), and ImportError if a processor module the plan needs does not import: both
    are permanent, so they are not hidden behind a fallback.
    """
    from llm_worker.sampling import (
        CounterSlots,
        ModelRunner,
        PreventedBoard,
        SamplingPlan,
        choose_model_runner,
        pin_model_runner,
    )

    choice = choose_model_runner(config.model_runner, device)
    pin_model_runner(choice.runner)
    runner = choice.runner
    board = None
    slots = None
    if config.constrain_audio_tokens:
        # This worker is the board's only owner: a predecessor killed with -9 (which the
        # orchestrator then restarted) could not unlink it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(board_name))
        board = PreventedBoard.create(board_name, slots=config.max_num_seqs + BOARD_SPARE_SLOTS)
        slots = CounterSlots(board)
    plan = SamplingPlan.for_config(
        config, runner, board=board.name if board else None, v2_processors=choice.v2_processors
    )
    try:
        head = choose_output_head(
            config.output_head,
            config.model,
            v1_runner=runner is ModelRunner.V1,
            tensor_penalty=plan.tensor_penalty,
        )
    except BaseException:
        if board is not None:
            board.close()
        raise
    return SamplingSetup(
        hooks=PlanHooks(plan, slots),
        logits_processors=plan.logits_processors(),
        description=f"{plan.describe()} [runner: {choice.reason}]",
        head=head,
        runner=runner,
        board=board,
    )
