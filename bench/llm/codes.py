"""``python -m bench.llm.codes [--json FILE]``: the worker's per-step host cost of
turning every stream's new audio tokens into SNAC frames, side by side in one run.

Variants, alternated within each round, on identical token streams (one new token per
stream per engine step, the steady state of decoding; 2% invalid tokens):

- ``per-token``: a straightforward per-stream, per-token Python loop (what a worker that
  consumes one request's outputs at a time does), producing the same frames;
- ``vectorised``: :class:`llm_worker.codes.FrameAssembler`, one call for all streams;
- ``vectorised+guard``: the same plus the repetition guard, as the worker runs it.

Reported: microseconds per engine step (median over rounds) and the ratio to per-token.
Both produce the same frames (checked), so the comparison is of cost only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import environment, show, table, write_json
from llm_worker.codes import FrameAssembler
from llm_worker.repetition import RepetitionGuard
from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE, FRAME_CODES

STREAM_COUNTS = (1, 16, 64, 384)
VARIANTS = ("per-token", "vectorised", "vectorised+guard")


def _token_streams(n_streams: int, n_steps: int, seed: int) -> np.ndarray:
    """``(n_steps, n_streams)`` token ids: valid audio tokens with 2% random invalid ones."""
    rng = np.random.default_rng(seed)
    pos = np.arange(n_steps)[:, None] % FRAME_CODES
    codes = rng.integers(0, CODEBOOK_SIZE, size=(n_steps, n_streams))
    toks = T.AUDIO_TOKEN_BASE + pos * CODEBOOK_SIZE + codes
    bad = rng.random((n_steps, n_streams)) < 0.02
    toks[bad] = rng.integers(0, T.AUDIO_TOKEN_END, size=int(bad.sum()))
    return toks


class _PerToken:
    """The per-token reference: Python lists, one stream and one token at a time."""

    def __init__(self, n_streams: int) -> None:
        self.pos = [0] * n_streams
        self.partial: list[list[int]] = [[] for _ in range(n_streams)]
        self.bad = [False] * n_streams

    def step(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        out = []
        for i, toks in enumerate(token_lists):
            frames = []
            for tok in toks:
                slot = self.pos[i] % FRAME_CODES
                code = tok - T.AUDIO_TOKEN_BASE - slot * CODEBOOK_SIZE
                if not 0 <= code < CODEBOOK_SIZE:
                    self.bad[i] = True
                self.partial[i].append(code)
                self.pos[i] += 1
                if slot == FRAME_CODES - 1:
                    if not self.bad[i]:
                        frames.append(self.partial[i])
                    self.partial[i], self.bad[i] = [], False
            out.append(np.array(frames, dtype="<i2").reshape(-1, FRAME_CODES))
        return out


def _run_variant(name: str, toks: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Seconds per step over all steps, and each stream's frames (for the equality check)."""
    n_steps, n_streams = toks.shape
    step_lists = [[[int(t)] for t in row] for row in toks]  # what vLLM hands the worker
    collected: list[list[np.ndarray]] = [[] for _ in range(n_streams)]
    run: Callable[[list[list[int]]], None]
    if name == "per-token":
        ref = _PerToken(n_streams)

        def run(lists: list[list[int]]) -> None:
            for i, f in enumerate(ref.step(lists)):
                collected[i].append(f)
    else:
        asm = FrameAssembler(capacity=n_streams)
        rows = np.array([asm.open() for _ in range(n_streams)], dtype=np.int64)
        guard = RepetitionGuard(48, capacity=n_streams) if name.endswith("guard") else None

        def run(lists: list[list[int]]) -> None:
            lens = np.fromiter((len(t) for t in lists), dtype=np.int64, count=len(lists))
            flat = np.fromiter(
                (t for ts in lists for t in ts), dtype=np.int64, count=int(lens.sum())
            )
            step = asm.map(rows, lens, flat)
            if guard is not None:
                guard.observe(rows, step.frames, step.counts)
            off = step.offsets()
            for i in np.flatnonzero(step.counts):
                collected[i].append(step.frames[off[i] : off[i + 1]].copy())

    t0 = time.perf_counter()
    for lists in step_lists:
        run(lists)
    elapsed = time.perf_counter() - t0
    frames = [np.concatenate(c) if c else np.zeros((0, 7), np.int16) for c in collected]
    return elapsed / n_steps, frames


def bench(stream_counts: tuple[int, ...], n_steps: int, rounds: int) -> list[dict[str, Any]]:
    results = []
    for n in stream_counts:
        toks = _token_streams(n, n_steps, seed=n)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        reference: list[np.ndarray] | None = None
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                t, frames = _run_variant(v, toks)
                times[v].append(t)
                if reference is None:
                    reference = frames
                elif not all(np.array_equal(a, b) for a, b in zip(reference, frames, strict=True)):
                    raise AssertionError(f"{v} produced different frames at {n} streams")
        med = {v: float(np.median(times[v])) * 1e6 for v in VARIANTS}
        results.append(
            {
                "streams": n,
                "steps": n_steps,
                "rounds": rounds,
                **{
                    f"us_per_step_{v.replace('+', '_').replace('-', '_')}": med[v] for v in VARIANTS
                },
                "vectorised_over_per_token": med["vectorised"] / med["per-token"],
                "guarded_over_per_token": med["vectorised+guard"] / med["per-token"],
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench codes", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAM_COUNTS))
    p.add_argument("--steps", type=int, default=140, help="engine steps per run (20 frames)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    results = bench(tuple(args.streams), args.steps, args.rounds)

    columns = ("streams", *VARIANTS, "vectorised / per-token", "+guard / per-token")
    rows = [
        (
            str(r["streams"]),
            f"{r['us_per_step_per_token']:.1f}",
            f"{r['us_per_step_vectorised']:.1f}",
            f"{r['us_per_step_vectorised_guard']:.1f}",
            f"{r['vectorised_over_per_token']:.2f}",
            f"{r['guarded_over_per_token']:.2f}",
        )
        for r in results
    ]
    show(table("tokens -> frames, host time per engine step (median µs)", columns, rows))
    if args.json:
        doc = {"benchmark": "codes", **environment(), "numpy": np.__version__, "results": results}
        write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
