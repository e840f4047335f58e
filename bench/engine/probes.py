"""What an engine's process reads of itself over a window: its EngineCore process's CPU time,
the GPU's busy fraction (NVML) and the engine core's per-phase host time."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.engine.levels import phase_key
from shm.layout import pid_alive


def engine_core_process() -> Any:
    """vLLM's EngineCore process (a child of this one), or None (in-process engine)."""
    import psutil

    me = psutil.Process()
    children = me.children(recursive=True)
    for p in children:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in p.name() or any("EngineCore" in a for a in p.cmdline()):
                return p
    return None


def cpu_seconds(proc: Any) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


class GpuBusy:
    """The fraction of time a kernel ran on GPU 0 over a window (NVML utilisation samples);
    None where there is no NVML (the CPU build, no pynvml)."""

    def __init__(self, device: str) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        self._since_us = 0
        if device != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py, which vLLM's CUDA build brings

            pynvml.nvmlInit()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as e:  # no NVML: the fraction is unknown, not an error
            print(f"GPU busy fraction unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    def start(self) -> None:
        self._since_us = int(time.time() * 1e6)

    def stop(self) -> float | None:
        if self._nvml is None:
            return None
        nv = self._nvml
        try:
            _, samples = nv.nvmlDeviceGetSamples(
                self._handle, nv.NVML_GPU_UTILIZATION_SAMPLES, self._since_us
            )
            values = [s.sampleValue.uiVal for s in samples if s.timeStamp >= self._since_us]
            if values:
                return sum(values) / len(values) / 100.0
            return nv.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except Exception:
            return None

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


class PhaseReader:
    """The per-phase totals an engine's vLLM processes write (llm_worker.vllm_ext.phase_timers)."""

    FRESH_TIMEOUT_S = 3.0
    """How long :meth:`stop` waits for every process's totals to be written after the window."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._before: dict[int, dict[str, Any]] = {}

    def _read(self) -> dict[int, dict[str, Any]]:
        if self.directory is None:
            return {}
        from llm_worker.vllm_ext.phase_timers import read_snapshots

        return read_snapshots(self.directory)

    def start(self) -> None:
        self._before = self._read()

    def _read_after(self, mark: float) -> dict[int, dict[str, Any]]:
        """Snapshots each written at or after ``mark`` (wall time), by every live process
        that wrote one before. Each process writes every ``WRITE_INTERVAL_S`` from its own
        thread, so a read at the window's end can hold a file from before its start (a busy
        engine core's writer thread waits for the GIL): a phase would then look idle. Waits
        at most ``FRESH_TIMEOUT_S``; a process that has not written by then is read as is."""
        deadline = time.monotonic() + self.FRESH_TIMEOUT_S
        while True:
            snaps = self._read()
            stale = [
                pid
                for pid, snap in snaps.items()
                if snap.get("time", 0.0) < mark and pid_alive(pid)
            ]
            if not stale or time.monotonic() >= deadline:
                return snaps
            time.sleep(0.05)

    def stop(self) -> tuple[dict[str, float], dict[str, float]] | None:
        if self.directory is None:
            return None
        from llm_worker.vllm_ext.phase_timers import us_per_request_step

        phases, batch = us_per_request_step(self._before, self._read_after(time.time()))
        return dict(sorted(phases.items(), key=lambda kv: phase_key(kv[0]))), batch

    def describe(self) -> str | None:
        """Which methods were wrapped and which the installed vLLM lacks (one line)."""
        snaps = self._read()
        if self.directory is None:
            return None
        if not snaps:
            return "no timers file appeared (is the project's vLLM plugin loaded?)"
        installed = sorted({m for s in snaps.values() for m in s.get("installed", [])})
        missing = sorted({m for s in snaps.values() for m in s.get("missing", [])} - set(installed))
        return f"timed: {', '.join(installed)}; not in this vLLM: {', '.join(missing) or '-'}"
