"""The codec worker's profiling hook: one torch-profiler capture per trigger.

Armed by ``ORPHEUS_PROFILE_DIR`` (common.profiling). The main loop checks the trigger
with its heartbeat (once a second) and, while a capture runs, whether it is over: an
attribute read per loop iteration. The trace is ``DIR/codec-<pid>.pt.trace.json.gz``.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time

import torch
from torch.profiler import ProfilerActivity

from codec_worker.engine import DecodeEngine
from common.profiling import ProfileTrigger

log = logging.getLogger(__name__)


class CodecProfiler:
    def __init__(self, trigger: ProfileTrigger, engine: DecodeEngine) -> None:
        self.trigger = trigger
        self.engine = engine
        self._prof: torch.profiler.profile | None = None
        self._label = ""
        self._started = 0.0
        self.until = float("inf")
        """Monotonic time at which the running capture ends (inf: none runs)."""

    def check_trigger(self) -> None:
        """Start a capture if a new trigger was written (call with the heartbeat)."""
        if self._prof is not None:
            return
        label = self.trigger.poll()
        if label is None:
            return
        activities = [ProfilerActivity.CPU]
        if self.engine.cuda:
            activities.append(ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        prof.start()
        self._prof, self._label, self._started = prof, label, time.time()
        self.engine.profiling = True
        self.until = time.monotonic() + self.trigger.seconds
        log.info("profiling %.1f s (%s)", self.trigger.seconds, label)

    def finish(self) -> None:
        """End the running capture, write its trace and the ``.done`` file."""
        prof, self._prof = self._prof, None
        self.until = float("inf")
        self.engine.profiling = False
        if prof is None:
            return
        files: list[str] = []
        error = ""
        try:
            prof.stop()
            path = self.trigger.trace_path()
            raw = path.with_suffix("")  # .pt.trace.json
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.unlink(raw)
            files.append(str(path))
        except Exception as e:  # a failed capture must not stop the worker
            log.exception("profiling capture failed")
            error = f"{type(e).__name__}: {e}"
        done = self.trigger.write_done(self._label, self._started, files, error)
        log.info("profile written: %s", done)
