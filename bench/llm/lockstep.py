"""In-process vLLM engines stepped in lockstep (``bench penalties``, ``bench voices``).

Each variant has its own engine, and the engines take one decode step each in turn, the
order rotated every step. Alternating at step granularity puts every variant under the
same load from the machine's other tenants, which on a shared machine moves a single run's
time by ±20% within minutes. A step's cost is the process CPU time of ``LLMEngine.step()``
(in the CPU build all of it runs on this process's CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

TEXTS = (
    "Hello there! How are you doing today?",
    "The weather is lovely this morning, with a light breeze.",
    "Could you tell me the way to the library, please?",
    "We will meet at the station at half past seven; please do not be late.",
    "Thank you very much, and have a nice day.",
    "Reading aloud is a skill that improves with practice.",
    "Voice assistants read messages, answer questions and tell stories.",
    "The river flows quietly through the valley, past farms and small villages.",
)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # tiny model: layers * (K, V) * kv heads * dim * fp32


def add_lockstep_arguments(p: argparse.ArgumentParser, *, tokens: int) -> None:
    """The batches the engines decode: ``--tokens`` per stream, ``--rounds``, ``--skip``."""
    p.add_argument("--tokens", type=int, default=tokens, help="tokens per stream per batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", type=int, default=2, help="decode steps not counted per batch")


def step_in_lockstep(engines: Mapping[str, Any], steps: int) -> dict[str, list[float]]:
    """``steps`` steps of every engine, in lockstep: the CPU ms of each, by variant. Then
    every engine runs (untimed) until it has no request left."""
    names = list(engines)
    cpu: dict[str, list[float]] = {v: [] for v in names}
    for step in range(steps):
        k = step % len(names)
        for v in names[k:] + names[:k]:
            c0 = time.process_time()
            engines[v].step()
            cpu[v].append((time.process_time() - c0) * 1e3)
    for engine in engines.values():
        while engine.has_unfinished_requests():  # nothing left in steady state
            engine.step()
    return cpu


def paired_median(steps: Sequence[float], reference: Sequence[float]) -> float:
    """The median over lockstep cycles of the ratio of a variant's step to the reference's
    (each ratio compares steps taken back to back)."""
    return statistics.median(x / y for x, y in zip(steps, reference, strict=True))
