"""The llm worker's profiling hook: vLLM's torch profiler, started and stopped per trigger.

Armed by ``ORPHEUS_PROFILE_DIR`` (common.profiling): the engine is then built with a
``ProfilerConfig`` writing under ``DIR/engine`` (the engine core traces CPU ops and CUDA
kernels; AsyncLLM traces this process), and a task checks the trigger every 0.5 s.
"""

from __future__ import annotations

import asyncio
import logging
import time

from vllm.config import ProfilerConfig
from vllm.v1.engine.async_llm import AsyncLLM

from common.profiling import ProfileTrigger

log = logging.getLogger(__name__)

POLL_S = 0.5
ENGINE_TRACES = "engine"


def engine_profiler_config(trigger: ProfileTrigger) -> ProfilerConfig:
    return ProfilerConfig(
        profiler="torch",
        torch_profiler_dir=str(trigger.directory / ENGINE_TRACES),
        torch_profiler_with_stack=False,
        torch_profiler_record_shapes=False,
        torch_profiler_use_gzip=True,
    )


async def profile_on_trigger(engine: AsyncLLM, trigger: ProfileTrigger) -> None:
    """Run forever: one capture of ``trigger.seconds`` per new trigger."""
    traces = trigger.directory / ENGINE_TRACES
    while True:
        await asyncio.sleep(POLL_S)
        label = trigger.poll()
        if label is None:
            continue
        log.info("profiling %.1f s (%s)", trigger.seconds, label)
        started = time.time()
        error = ""
        try:
            await engine.start_profile()
            await asyncio.sleep(trigger.seconds)
            await engine.stop_profile()
        except Exception as e:  # a failed capture must not stop the worker
            log.exception("profiling capture failed")
            error = f"{type(e).__name__}: {e}"
        done = trigger.write_done(label, started, trigger.files_since(started, traces), error)
        log.info("profile written: %s", done)
