"""A gateway process exactly as served (``gateway.main.run``) in front of the synthetic backend
(``testkit.synthetic_backend``: it plays the llm_worker and codec_worker, real-time
paced, in a process of its own): what ``bench gateway``, ``bench jobs`` and ``bench protocols``
measure.

``with SyntheticGateway(configure, **source) as gw:`` makes a private instance (run
directory, PCM ring, a free port), starts the source, then the gateway, and returns once the
gateway reported ready (as it would to the orchestrator); on leaving (or a failed start) the
gateway is stopped with SIGTERM (it drains), then the source, and the ring, sockets and run
directory are removed. The sentence audio cache (on by default) keeps its files in the
run directory unless ``cache.dir`` is set; the benchmarks' clients send
``Cache-Control: no-store`` where they measure synthesis.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from common.config import ServeConfig
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.messages import WorkerReady, orchestrator_decoder
from shm.ring import create_ring, unlink_ring
from testkit.local_server import free_port

START_TIMEOUT_S = 60.0

Configure = Callable[[ShmConfig, int, str], ServeConfig]
"""The gateway's configuration from the instance's ``[shm]`` table, its port and run
directory (a place for the benchmark's own state: a jobs directory)."""


def _run_source(layout: InstanceLayout, options: dict[str, Any], stop: Any, ready: Any) -> None:
    from testkit.synthetic_backend import SyntheticBackend

    src = SyntheticBackend(layout, realtime=True, **options)
    ready.set()
    src.run(stop)


def _run_gateway(config: ServeConfig, layout: InstanceLayout) -> None:
    from common.memory_probe import install_from_environment
    from gateway.main import run

    install_from_environment()  # as orchestrator.child does: only with ORPHEUS_PROFILE_MEMORY
    run(config, layout, 0)


class SyntheticGateway:
    def __init__(self, configure: Configure, **source: Any) -> None:
        """``source``: the synthetic backend's options besides real-time pacing
        (``first_chunk_delay_s``, ``stamp``, ``tick_s``)."""
        self.ctx = mp.get_context("spawn")
        self.run_dir = tempfile.mkdtemp(prefix="orpheus-bench-")
        self.layout = InstanceLayout.for_pid(os.getpid(), self.run_dir, 1)
        os.makedirs(self.layout.socket_dir)
        shm = ShmConfig(run_dir=self.run_dir)
        create_ring(self.layout.pcm_ring(0), shm.pcm_ring_bytes)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = configure(shm, self.port, self.run_dir)
        if not config.cache.dir:  # the sentence audio cache's sightings and entries: here,
            # removed with the run, not in the user's state directory
            cache = msgspec.structs.replace(config.cache, dir=os.path.join(self.run_dir, "cache"))
            config = msgspec.structs.replace(config, cache=cache)
        self.config = config
        self.stop = self.ctx.Event()
        self._source_options = source
        self.source: Any = None
        self.gateway: Any = None
        """The two processes (``multiprocessing.Process``), once started."""

    def __enter__(self) -> SyntheticGateway:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        import zmq

        with zmq.Context.instance().socket(zmq.PULL) as orch:
            orch.setsockopt(zmq.LINGER, 0)
            orch.bind(self.layout.orch)
            ready = self.ctx.Event()
            self.source = self.ctx.Process(
                target=_run_source,
                args=(self.layout, self._source_options, self.stop, ready),
                daemon=True,
            )
            self.source.start()
            if not ready.wait(START_TIMEOUT_S):
                raise RuntimeError("the synthetic source did not start")
            self.gateway = self.ctx.Process(
                target=_run_gateway, args=(self.config, self.layout), daemon=True
            )
            self.gateway.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if time.monotonic() > deadline or not self.gateway.is_alive():
                    raise RuntimeError("the gateway did not report ready")
                msg = orch.poll(200) and orchestrator_decoder.decode(orch.recv())
                if isinstance(msg, WorkerReady):
                    return

    def close(self) -> None:
        if self.gateway is not None and self.gateway.pid is not None and self.gateway.is_alive():
            os.kill(self.gateway.pid, signal.SIGTERM)
            self.gateway.join(20)
        self.stop.set()
        if self.source is not None:
            self.source.join(10)
        for p in (self.gateway, self.source):
            if p is not None and p.is_alive():
                p.kill()
                p.join(5)
        unlink_ring(self.layout.pcm_ring(0))
        shutil.rmtree(self.run_dir, ignore_errors=True)
