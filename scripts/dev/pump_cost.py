"""The llm worker's per-step publish (``LLMService.pump``) in isolation: CPU time per engine
step for N streams, with the tests' fakes of the engine and the ring (tests/harness/
llm_fakes.py), so that a change to the service's rooms is measured without vLLM or a ring.

    PYTHONPATH=. python scripts/dev/pump_cost.py --streams 64,256 --steps 2000 --json out.json

Each stream has one request; every step delivers one audio token per stream (a frame
completes every 7th step), the service maps and stages them, and the pump is timed.
Compare two commits by running this file with ``PYTHONPATH`` set to each checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "harness"))
from llm_fakes import FakeEngine, FakePrompts, MemorySink, audio

from common.config.llm import LLMConfig
from llm_worker.model_info import ModelInfo
from llm_worker.service import LLMService
from shm.messages import LlmSubmit

INFO = ModelInfo(voices=("tara",), emotion_tags=(), source="bench", zero_shot=False)


async def level(streams: int, steps: int, repeats: int) -> dict[str, float]:
    config = LLMConfig(model="unused", max_model_len=4096, max_tokens_cap=4096)
    engine, sink = FakeEngine(), MemorySink(max_payload=1 << 20)
    svc = LLMService(config, engine, sink, FakePrompts(), INFO)  # type: ignore[arg-type]
    for i in range(streams):
        await svc.handle(LlmSubmit(stream_id=i + 1, voice="tara", text="Hello there."))
    await svc.pump()  # the submits' nothing-yet
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 4096, (steps // 7 + 2, 7)).astype(np.int16)
    tokens = np.asarray(audio(codes)) + 0  # audio ids, one per step
    rids = [req.request_id for req in engine.requests]
    per_step: list[float] = []
    for r in range(repeats):
        times = []
        for k in range(steps):
            t = [int(tokens[(r * steps + k) % len(tokens)])]
            for rid in rids:
                engine.emit(rid, t)
            t0 = time.perf_counter()
            await svc.pump()
            times.append(time.perf_counter() - t0)
            sink.records.clear()
        per_step.append(statistics.median(times) * 1e6)
    return {"streams": streams, "pump_us_median": min(per_step), "repeats_us": per_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="64,256")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = [asyncio.run(level(int(n), args.steps, args.repeats)) for n in args.streams.split(",")]
    print(f"{'streams':>8} {'pump µs/step (median, best of repeats)':>40}  {args.label}")
    for row in rows:
        print(f"{row['streams']:>8} {row['pump_us_median']:>40.1f}")
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "levels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
