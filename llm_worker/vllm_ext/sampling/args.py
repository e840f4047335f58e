"""The per-request arguments of our logits processors, carried in ``SamplingParams.extra_args``.

One key, ``extra_args["orpheus"]``, holds a small dict so that the worker's other
extra arguments never collide with ours::

    {"repetition_penalty": 1.1, "constrain_audio": True, "board": "orpheus-42-prevented", "slot": 7}

A request without the key is left alone by every processor in this package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams

from llm_worker.vllm_ext.sampling.counters import SINK

EXTRA_ARGS_KEY = "orpheus"


@dataclass(frozen=True, slots=True)
class RequestArgs:
    repetition_penalty: float = 1.0
    """Applied by our tensor penalty (vLLM's own ``repetition_penalty`` must then be 1.0)."""
    constrain_audio: bool = False
    """After the prompt (which ends with start-of-speech), sample only valid audio tokens."""
    board: str | None = None
    """Shared-memory board that receives the prevented-token counts (None: not counted)."""
    slot: int = SINK
    """The request's counter on the board (0: the board's sink, counted in the total only)."""

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    def to_extra_args(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.penalised:
            d["repetition_penalty"] = self.repetition_penalty
        if self.constrain_audio:
            d["constrain_audio"] = True
        if self.board is not None:
            d["board"] = self.board
            d["slot"] = self.slot
        return {EXTRA_ARGS_KEY: d} if d else {}

    @classmethod
    def of(cls, params: SamplingParams) -> RequestArgs | None:
        """The request's arguments, or None when it carries none. Raises ValueError if malformed."""
        raw = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict")
        unknown = set(raw) - {"repetition_penalty", "constrain_audio", "board", "slot"}
        if unknown:
            raise ValueError(f"unknown extra_args[{EXTRA_ARGS_KEY!r}] keys: {sorted(unknown)}")
        penalty = raw.get("repetition_penalty", 1.0)
        if isinstance(penalty, bool) or not isinstance(penalty, int | float):
            raise ValueError("repetition_penalty must be a number")
        penalty = float(penalty)
        if not (math.isfinite(penalty) and penalty > 0.0):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {penalty}")
        if penalty != 1.0 and params.repetition_penalty != 1.0:
            raise ValueError(
                "both vLLM's repetition_penalty and the tensor penalty are set: "
                "the penalty would be applied twice"
            )
        board = raw.get("board")
        if board is not None and not isinstance(board, str):
            raise ValueError("board must be a shared-memory segment name")
        slot = raw.get("slot", SINK)
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ValueError("slot must be an int >= 0")
        return cls(
            repetition_penalty=penalty,
            constrain_audio=bool(raw.get("constrain_audio", False)),
            board=board,
            slot=slot,
        )
