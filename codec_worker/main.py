"""The codec_worker process: code ring in, PCM rings out.

``run(config, layout)`` loads SNAC, compiles and warms the decoder, attaches to every engine's
code ring (consumer) and to every gateway's PCM ring (producer), tells the orchestrator it is
ready, then serves until SIGTERM/SIGINT: poll the code rings, apply their records, finish the
batch in flight, dispatch the next (one decode batch across the streams of every engine),
sleep on all the rings' doorbells when there is nothing to do.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import torch
from snac import SNAC

from codec_worker import metrics
from codec_worker.decoder import WindowDecoder
from codec_worker.encoder import EncodeServer, VoiceEncoder
from codec_worker.engine import DecodeEngine
from codec_worker.host_memory import retain_freed_memory
from codec_worker.output import RingSink
from codec_worker.profiling import CodecProfiler
from codec_worker.service import CodecService
from codec_worker.snac_model import load_snac
from codec_worker.watermark import load_watermark
from codec_worker.watermark.detect import ClipDetector
from common.config import ServeConfig
from common.link import WorkerLink
from common.profiling import ProfileTrigger
from common.tracing import setup_tracing
from shm.layout import InstanceLayout
from shm.ring import ReaderGroup, RingReader, RingWriter

log = logging.getLogger(__name__)

ROLE = "codec"
MAX_SLEEP_S = 0.25


def build_engine(config: ServeConfig, snac: SNAC | None = None) -> tuple[DecodeEngine, float]:
    """Load the codec (unless given) and warm it on every hot window shape. Returns
    (engine, warm-up s)."""
    cfg = config.codec
    device = torch.device(config.device)
    if device.type == "cuda":
        # The decoder stays FP32: no TF32 rounding in its convolutions (this process only).
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        retain_freed_memory()
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
    if snac is None:
        snac = load_snac(cfg.model, "cpu")
    # Loaded before the decoder's warm-up: a watermark that cannot load stops the start at
    # once (WatermarkUnavailable: a permanent failure, exit 78), and the warm-up runs it too.
    watermark = load_watermark(cfg.watermark, device)
    engine = DecodeEngine.for_config(WindowDecoder(snac), cfg, device, watermark)
    return engine, engine.warmup()


def run(config: ServeConfig, layout: InstanceLayout) -> None:
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    cfg = config.codec
    t0 = time.monotonic()
    snac = load_snac(cfg.model, "cpu")
    engine, warm_s = build_engine(config, snac)
    # Custom voices: reference clips are encoded on a thread of this process (encoder.py).
    # ... and clips' watermarks read (POST /v1/watermark/detect), on the same thread.
    detector = ClipDetector(engine.watermark, torch.device(config.device))
    voice_encoder = VoiceEncoder(snac.to(config.device), config.device)
    encoder = EncodeServer(voice_encoder, layout.encode, detector)
    encoder.start()
    readers = [
        RingReader(
            layout.engine_code_ring(e),
            spin_us=config.shm.spin_us,
            recheck_ms=config.shm.recheck_ms,
        )
        for e in range(layout.engines)
    ]
    rings = ReaderGroup(readers)
    writers = [
        RingWriter(layout.pcm_ring(i), recheck_ms=config.shm.recheck_ms)
        for i in range(layout.gateways)
    ]
    sink = RingSink(writers, cfg.pcm_stall_timeout_s)
    tracing = setup_tracing("codec", config.otlp_traces_endpoint)
    service = CodecService(cfg, engine, sink, layout.gateways, tracing=tracing)
    link = WorkerLink(layout.orch, ROLE)
    detail = (
        f"SNAC from {cfg.model} on {config.device}, compile={cfg.compile}, "
        f"watermark={cfg.watermark}, "
        f"warm-up {warm_s:.1f}s, loaded in {time.monotonic() - t0:.1f}s"
    )
    profiler: CodecProfiler | None = None
    trigger = ProfileTrigger.from_env("codec")
    if trigger is not None:
        profiler = CodecProfiler(trigger, engine)
        log.info("profiling hooks armed: %s", trigger.directory)
    link.ready(detail)
    log.info("codec worker ready: %s", detail)
    try:
        while not stop.is_set():
            for engine, reader in enumerate(readers):
                records = reader.poll()
                if records:
                    service.ingest(records, engine)
                    reader.release()
            service.pump()
            now = time.monotonic()
            if link.beat_if_due(len(service.streams), now):
                _observe_rings(readers, sink)
                if profiler is not None:
                    profiler.check_trigger()
            if profiler is not None and now >= profiler.until:
                profiler.finish()
            if service.busy or rings.has_data():
                continue
            sleep = min(service.next_wakeup_s(now), link.seconds_to_beat(now), MAX_SLEEP_S)
            if sleep > 0:
                rings.wait(sleep)
        service.drain()
    finally:
        if profiler is not None:
            profiler.finish()
        encoder.stop()
        link.close()
        for reader in readers:
            reader.close()
        for w in writers:
            w.close()
        if tracing is not None:
            tracing.shutdown()  # exports the spans still buffered
        log.info("codec worker stopped")


def _observe_rings(readers: list[RingReader], sink: RingSink) -> None:
    for e, reader in enumerate(readers):
        metrics.RING_OCCUPANCY.labels(f"codes-{e}").set(reader.used_bytes() / reader.capacity)
    for i, occupancy in enumerate(sink.occupancy()):
        metrics.RING_OCCUPANCY.labels(f"pcm-{i}").set(occupancy)
