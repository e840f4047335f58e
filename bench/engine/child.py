"""One engine's process (``python -m bench.engine --run-variant ...``): builds its engine,
then runs each level the parent starts and reports it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.engine.channel import EngineSide, board_name
from bench.engine.levels import shares, summarize_engine
from bench.engine.loop import Loop
from bench.engine.probes import PhaseReader, cpu_seconds, engine_core_process
from bench.engine.results import PHASES_ENV, EngineLevel
from bench.engine.variants import check_head, engine_config
from bench.llm.lockstep import TEXTS


async def run_level(
    side: EngineSide,
    engine: Any,
    index: int,
    streams: int,
    args: argparse.Namespace,
    make_params: Any,
    prompts: list[list[int]],
    core: Any,
    phases: PhaseReader,
) -> EngineLevel:
    """One level of this engine: fill, warm up, then measure from the parent's ``go`` to
    its ``stop`` (which it sends once every engine has run ``--steps`` steps)."""
    import psutil

    loop = Loop(engine, make_params, prompts, streams, args.tokens)
    engine.on_step(loop.on_step)
    pump = asyncio.create_task(loop.pump(), name="pump")
    me = psutil.Process()
    try:
        await loop.fill()
        await loop.wait_steps(args.warmup_steps, pump)
        await side.send({"warm": True})
        msg = await side.recv()
        if not msg.get("go"):
            raise RuntimeError(f"expected go, got {msg!r}")
        t_go = time.perf_counter()
        first = len(loop.stamps) - 1
        tokens0 = loop.delivered
        core0 = cpu_seconds(core) if core is not None else None
        me0 = cpu_seconds(me)
        phases.start()
        recv = asyncio.create_task(side.recv())
        reach = asyncio.create_task(loop.wait_until(first + 1 + args.steps, pump))
        await asyncio.wait({recv, reach}, return_when=asyncio.FIRST_COMPLETED)
        if reach.done():
            reach.result()
            await side.send({"reached": True})
            msg = await recv
        else:
            reach.cancel()
            msg = recv.result()
        if not msg.get("stop"):
            raise RuntimeError(f"expected stop, got {msg!r}")
        t_stop = time.perf_counter()
        # Tokens of the window's steps: read by the pump just after each signal.
        await asyncio.sleep(0)
        tokens = loop.delivered - tokens0
        core_s = cpu_seconds(core) - core0 if core is not None and core0 is not None else None
        me_s = cpu_seconds(me) - me0
        timed = await asyncio.to_thread(phases.stop)  # waits for fresh totals (bounded)
        stamps = [t for t in loop.stamps[max(first, 0) :] if t <= t_stop]
    finally:
        engine.on_step(None)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
    level = summarize_engine(
        index, streams, stamps, tokens, t_stop - t_go, core_s, me_s, timed
    )  # fmt: skip
    await side.send({"result": msgspec.to_builtins(level)})
    await loop.stop()
    return level


async def serve_engine(args: argparse.Namespace, side: EngineSide) -> None:
    """Build this engine (its share of the device), say ready, then run the levels the
    parent asks for until it says quit."""
    from llm_worker.engine.engine import GenerationEngine
    from llm_worker.engine.info import describe_engine
    from llm_worker.engine.plan import plan_engine
    from llm_worker.prompt import PromptBuilder
    from llm_worker.requests import RequestPlan, segment_params

    variant = args.run_variant
    most = max(max(shares(n, args.engine_count)) for n in args.streams if n >= args.engine_count)
    cfg = engine_config(args, variant, most)
    engine_plan = plan_engine(cfg, board_name(os.getpid()), args.device)
    sampling = engine_plan.sampling
    generation = None
    try:
        check_head(variant, engine_plan.head, args.lever_head)
        generation = GenerationEngine.start(cfg, args.device, engine_plan)
        info = describe_engine(generation.llm, args.device).describe()
        builder = PromptBuilder.from_pretrained(cfg.tokenizer or cfg.model)
        voice = cfg.default_voice
        prompts = builder.build_many(voice, list(TEXTS))
        vs = cfg.voice_sampling.get(voice, cfg.sampling)
        plan = RequestPlan(
            voice=voice, kind="model", sampling=vs, seed=None, total_tokens=args.tokens
        )
        counter = sampling.hooks.acquire()
        kwargs = sampling.hooks.kwargs(vs, counter)
        chars = len(TEXTS[0])
        stop_id = generation.space.end_of_speech

        def make_params(prompt_len: int, tokens: int) -> Any:
            return segment_params(cfg, plan, 0, chars, prompt_len, tokens, kwargs, stop_id)

        core = engine_core_process()
        env_dir = os.environ.get(PHASES_ENV, "").strip()
        phases = PhaseReader(Path(env_dir) if env_dir else None)
        await side.send({
            "ready": {
                "engine": f"{info}; output head: {engine_plan.head.describe()}",
                "sampling": sampling.description,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "max_num_seqs": cfg.max_num_seqs,
            }
        })  # fmt: skip
        while True:
            msg = await side.recv()
            if msg.get("quit"):
                await side.send({"phase_timers": phases.describe()})
                return
            n = int(msg["level"])
            level = await run_level(
                side, generation, args.engine_index, n, args, make_params, prompts, core, phases
            )  # fmt: skip
            print(
                f"  {variant} K={args.engine_count} engine {args.engine_index} N={n}: step p50 "
                f"{level.step_ms_p50:.2f} ms, p99 {level.step_ms_p99:.2f} ms, "
                f"{level.tokens_per_s:.0f} tokens/s, {level.phases_us_per_request_step}",
                flush=True,
            )
    finally:
        if generation is not None:
            generation.llm.shutdown()
        engine_plan.close()


def engine_main(args: argparse.Namespace) -> int:
    """An engine's own process: serve the parent over the control channel."""
    import uvloop

    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])

    async def main() -> int:
        side = await EngineSide.open(args.control_fd)
        try:
            await serve_engine(args, side)
            return 0
        except Exception as e:  # the one line the table shows; the log has the rest
            import traceback

            traceback.print_exc()
            first = " ".join(str(e).split())
            with contextlib.suppress(Exception):
                await side.send({"error": f"{type(e).__name__}: {first}"[:300]})
            return 1

    return uvloop.run(main())
