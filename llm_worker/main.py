"""The llm_worker process: control messages in, code frames out.

``run(config, layout, engine)``: the worker of vLLM engine ``engine`` (0 .. ``llm.engines`` - 1;
each engine is one such process with its own sockets and code ring). Loads the tokenizer,
the model's voices and the vLLM engine,
runs the warm-up batch (:mod:`llm_worker.engine.warmup`: every batch size up to 72 rows, above
vLLM's sampler thresholds), tells the orchestrator it is ready, then serves until
SIGTERM/SIGINT:

- PULL ``layout.engine_control(engine)`` (bound here): ``LlmSubmit`` / ``LlmAppendText`` / ``LlmCancel`` from the
  gateways, handled in arrival order;
- the pump (:class:`llm_worker.service.LLMService`) publishes each engine step's frames to
  the engine's code ring (:class:`llm_worker.output.RingSink`: producer of
  ``layout.engine_code_ring(engine)``, created by the orchestrator), which begins with a
  ``RESET`` record: the codec worker drops what a dead predecessor left of its streams;
- PUSH ``layout.orch``: ``WorkerReady`` once warm, ``Heartbeat`` every second;
- ROUTER ``layout.engine_admin(engine)``: LoRA loads, unloads and syncs from the gateways, and every
  ``llm.lora_sync_s`` the LoRA voices other workers sharing the state directory changed.

On SIGTERM the streams still held get ERROR 503 ("shutdown"); if the engine dies they get
ERROR "worker_restarted" and the process exits non-zero so that the orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time

import uvloop
import zmq
import zmq.asyncio
from prometheus_client import multiprocess
from vllm.v1.engine.async_llm import AsyncLLM

from common.config import ServeConfig
from common.link import WorkerLink
from common.profiling import ProfileTrigger
from common.tracing import Tracing, setup_tracing
from common.zmq_recv import incoming, incoming_multipart
from llm_worker import metrics as M
from llm_worker.engine.engine import GenerationEngine
from llm_worker.engine.info import describe_engine
from llm_worker.engine.plan import EnginePlan, plan_engine
from llm_worker.engine.warmup import warm_up
from llm_worker.model_info import ModelInfo, load_model_info
from llm_worker.output import RingSink
from llm_worker.profiling import engine_profiler_config, profile_on_trigger
from llm_worker.prompt import PromptBuilder
from llm_worker.service import LLMService
from llm_worker.vllm_ext.token_space import HeadKind
from llm_worker.voices.custom import ZeroShotVoices
from llm_worker.voices.lora import LoraVoices
from shm.layout import InstanceLayout
from shm.messages import (
    UNDECODABLE,
    AdminReply,
    admin_request_decoder,
    control_encoder,
    llm_control_decoder,
)
from shm.records import RecordKind
from shm.ring import RingWriter
from store.lora import LoraRegistry
from store.voices import VoiceStore

log = logging.getLogger(__name__)

ROLE = "llm"
ENGINE_STATS_S = 10.0
STATS_POLL_S = 1.0
ENGINE_SHUTDOWN_S = 2.0


def run(config: ServeConfig, layout: InstanceLayout, engine: int = 0) -> None:
    """Serve engine ``engine`` until SIGTERM/SIGINT (see the module docstring)."""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config, layout, engine))
    finally:
        # Everything is closed by now. Collecting the engine's large heap at interpreter
        # exit takes seconds on a busy host (and the orchestrator's stop timeout counts them):
        # move it out of the collector's reach.
        gc.freeze()


def role_name(engine: int, engines: int) -> str:
    """The worker's name in heartbeats: ``llm``, or ``llm-<engine>`` when there are several."""
    return f"{ROLE}-{engine}" if engines > 1 else ROLE


async def serve(config: ServeConfig, layout: InstanceLayout, engine_index: int = 0) -> None:
    cfg = config.llm
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    t0 = time.monotonic()
    info: ModelInfo = load_model_info(cfg)
    prompts = PromptBuilder.from_pretrained(cfg.tokenizer or cfg.model)
    log.info("voices (%s): %s", info.source, ", ".join(info.voices))

    ctx = zmq.asyncio.Context()
    link = WorkerLink(layout.orch, role_name(engine_index, layout.engines), ctx)
    control = ctx.socket(zmq.PULL)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(layout.engine_control(engine_index))
    admin = ctx.socket(zmq.ROUTER)
    admin.setsockopt(zmq.LINGER, 0)
    admin.bind(layout.engine_admin(engine_index))
    writer = RingWriter(layout.engine_code_ring(engine_index), recheck_ms=config.shm.recheck_ms)
    # A new producer: what a dead predecessor left of its streams in the codec goes first.
    writer.append(RecordKind.RESET, 0, 0, b"", cfg.ring_full_timeout_s)
    writer.publish()
    plan = plan_engine(cfg, f"{layout.instance}-prevented-{engine_index}", config.device)
    engine: AsyncLLM | None = None
    service: LLMService | None = None
    tracing: Tracing | None = None
    tasks: list[asyncio.Task[None]] = []

    def engine_alive() -> None:
        # A dead engine must not look alive to the orchestrator: raising ends the heartbeat
        # task, which ends the worker (exit non-zero, restarted).
        if engine is not None and engine.errored:
            raise engine.dead_error

    try:
        trigger = ProfileTrigger.from_env("llm")
        profiler = engine_profiler_config(trigger) if trigger is not None else None
        generation = GenerationEngine.start(cfg, config.device, plan, profiler)
        engine = generation.llm
        engine_info = describe_engine(engine, config.device)
        log.info("engine: %s", engine_info.describe())
        log.info("sampling: %s", plan.sampling.description)
        log.info("output head: %s", plan.head.describe())
        warm = await warm_up(generation, prompts, cfg, plan.sampling.hooks)
        log.info("engine %s", warm.describe())
        if stop.is_set():
            log.info("llm worker stopped during start-up")
            return
        store = VoiceStore(config.voices.state_dir)
        custom = ZeroShotVoices(store, prompts, info.zero_shot)
        loras = LoraVoices(
            cfg,
            LoraRegistry(config.voices.state_dir),
            info.voices,
            store,
            audio_head=generation.space.kind is HeadKind.AUDIO,
        )
        await loras.restore(engine)
        sink = RingSink(writer, cfg.ring_full_timeout_s)
        tracing = setup_tracing("llm", config.otlp_traces_endpoint)
        service = LLMService(
            cfg, generation, sink, prompts, info, plan.sampling.hooks, custom, loras, tracing
        )
        generation.on_step(service.on_step)
        detail = (
            f"{engine_info.describe()}; {warm.describe()}; ready in {time.monotonic() - t0:.1f}s"
        )
        link.ready(detail)
        log.info("llm worker ready: %s", detail)

        tasks = [
            asyncio.create_task(service.run(), name="pump"),
            asyncio.create_task(_control_loop(control, service), name="control"),
            asyncio.create_task(_admin_loop(admin, engine, loras), name="admin"),
            asyncio.create_task(
                link.beat_forever(lambda: service.active_streams, engine_alive), name="heartbeat"
            ),
            asyncio.create_task(_engine_stats_loop(engine, plan), name="engine-stats"),
        ]
        if loras.enabled and cfg.lora_sync_s > 0:
            tasks.append(
                asyncio.create_task(
                    _lora_sync_loop(engine, loras, cfg.lora_sync_s), name="lora-sync"
                )
            )
        if trigger is not None:
            log.info("profiling hooks armed: %s", trigger.directory)
            tasks.append(asyncio.create_task(profile_on_trigger(engine, trigger), name="profile"))
        stopped = asyncio.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        for t in done:
            if t is not stopped and not t.cancelled() and (exc := t.exception()) is not None:
                raise exc
        log.info("llm worker stopping")
        await _stop_tasks(tasks)
        await service.shutdown()
    except BaseException:
        await _stop_tasks(tasks)
        if service is not None:
            with contextlib.suppress(Exception):
                await service.shutdown("worker_restarted", "the llm worker failed; retry")
        raise
    finally:
        if engine is not None:
            # The streams were failed or ended already: nothing in the engine is worth
            # vLLM's default grace period before it kills its processes.
            engine.shutdown(timeout=ENGINE_SHUTDOWN_S)
        control.close(linger=0)
        admin.close(linger=0)
        link.close()
        writer.close()
        plan.close()
        if tracing is not None:
            tracing.shutdown()  # exports the spans still buffered
        ctx.term()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Drops this pid's live gauges (active streams) from the shared metrics.
            multiprocess.mark_process_dead(os.getpid())
        log.info("llm worker stopped")


async def _stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _control_loop(sock: zmq.asyncio.Socket, service: LLMService) -> None:
    async for raw in incoming(sock):
        try:
            msg = llm_control_decoder.decode(raw)
        except UNDECODABLE as e:
            log.warning("undecodable control message dropped: %s", e)
            continue
        await service.handle(msg)


async def _admin_loop(sock: zmq.asyncio.Socket, engine: AsyncLLM, loras: LoraVoices) -> None:
    """Admin requests (LoRA load/unload) from the gateways, one at a time."""
    async for frames in incoming_multipart(sock):
        if len(frames) != 2:
            continue
        ident, raw = frames
        try:
            req = admin_request_decoder.decode(raw)
        except UNDECODABLE as e:
            log.warning("undecodable admin request dropped: %s", e)
            continue
        try:
            reply = await loras.handle(engine, req)
        except Exception as e:
            log.exception("admin request failed")
            reply = AdminReply(req.request_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart([ident, control_encoder.encode(reply)])


async def _lora_sync_loop(engine: AsyncLLM, loras: LoraVoices, period_s: float) -> None:
    """Follow the LoRA voices other workers sharing the state directory load and unload
    (``LoraVoices.sync``). A failed pass is logged and the next one tries again: the engine
    dying is the heartbeat's to notice."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await loras.sync(engine)
        except Exception:
            log.exception("LoRA voice sync failed")


async def _engine_stats_loop(engine: AsyncLLM, plan: EnginePlan) -> None:
    """The count of invalid tokens the constraint prevented (each second; the counters live
    in a shared segment the engine's processes write) and vLLM's periodic stats log."""
    prevented = plan.sampling.total_prevented()
    next_stats = time.monotonic() + ENGINE_STATS_S
    while True:
        await asyncio.sleep(STATS_POLL_S)
        total = plan.sampling.total_prevented()
        if total > prevented:
            M.INVALID_TOKENS_PREVENTED.inc(total - prevented)
            prevented = total
        if time.monotonic() >= next_stats:
            next_stats += ENGINE_STATS_S
            await engine.do_log_stats()
