"""Wiring of the sampling package (:mod:`llm_worker.vllm_ext.sampling`) into the worker, for a model
runner already chosen (:func:`llm_worker.engine.plan.plan_engine` chooses and pins it).

The package supplies the logits processors (tensor repetition penalty on the legacy model
runner, audio-token constraint) and the per-request arguments that switch them on. This
module creates the prevented-token board, picks the processors for the runner, and gives
the service the per-stream side (:class:`llm_worker.vllm_ext.sampling.hooks.PlanHooks`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from common.config.llm import LLMConfig
from llm_worker.vllm_ext.sampling.hooks import PlanHooks, SamplingHooks
from shm.ring import segment_path

BOARD_SPARE_SLOTS = 64
"""Board slots beyond max_num_seqs: streams waiting for their next segment hold one too."""


@dataclass
class SamplingSetup:
    hooks: SamplingHooks
    logits_processors: list[type]
    description: str
    tensor_penalty: bool = False
    """Our tensor repetition penalty runs (the V1 runner's): the output head depends on it."""
    board: Any = None

    def total_prevented(self) -> int:
        return self.board.total() if self.board is not None else 0

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


def setup_sampling(
    config: LLMConfig, runner: Any, board_name: str, *, v2_processors: bool = False
) -> SamplingSetup:
    """The processors and hooks of ``runner`` (a ``ModelRunner``) for ``config``. Raises
    ImportError if a processor module the plan needs does not import (permanent: not
    hidden behind a fallback)."""
    from llm_worker.vllm_ext.sampling import CounterSlots, PreventedBoard, SamplingPlan

    board = None
    slots = None
    if config.constrain_audio_tokens:
        # This worker is the board's only owner: a predecessor killed with -9 (which the
        # orchestrator then restarted) could not unlink it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(board_name))
        board = PreventedBoard.create(board_name, slots=config.max_num_seqs + BOARD_SPARE_SLOTS)
        slots = CounterSlots(board)
    try:
        plan = SamplingPlan.for_config(
            config, runner, board=board.name if board else None, v2_processors=v2_processors
        )
        processors = plan.logits_processors()
    except BaseException:
        if board is not None:
            board.close()
        raise
    return SamplingSetup(
        hooks=PlanHooks(plan, slots),
        logits_processors=processors,
        description=plan.describe(),
        tensor_penalty=plan.tensor_penalty,
        board=board,
    )
