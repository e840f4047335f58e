"""TEST FIXTURE for the gateway tests: a gateway in the test's event loop, fed by
``testkit.synthetic_backend`` (a stand-in for the llm_worker + codec_worker that speaks the
real control socket and writes the real PCM ring). The real end-to-end tests, with vLLM
and SNAC, are elsewhere (tests/test_e2e_*.py)."""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from common.config import ServeConfig
from common.config.cache import CacheConfig
from common.config.gateway import GatewayConfig
from common.config.text import TextConfig
from common.tracing import Tracing
from gateway.app import build_app
from gateway.edge import malformed_http
from gateway.edge.listener import ConnectionGuard, Listener, app_runner, listen
from gateway.frontends.zeromq.server import ZmqFrontend
from gateway.main import reuseport_socket
from gateway.metrics import GatewayMetrics
from gateway.service import Gateway
from shm.layout import InstanceLayout
from shm.records import SAMPLE_RATE
from shm.ring import create_ring, unlink_ring
from testkit.synthetic_backend import SyntheticBackend

RING_BYTES = 4 << 20
NO_STORE = {"Cache-Control": "no-store"}
"""The header of a test that sends one text again and again to measure or count synthesis
(admission, placement, saturation): the sentence audio cache, on by default, would answer
its repeats, and its concurrent twins would share one synthesis (single flight)."""
BYTES_PER_FRAME = 2048 * 2


@dataclass
class Harness:
    gateway: Gateway
    backend: SyntheticBackend
    config: ServeConfig
    layout: InstanceLayout
    port: int
    guard: ConnectionGuard

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


async def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.01)


def serve_config(**gateway: Any) -> ServeConfig:
    """The harness's configuration. Text normalisation is off: the synthetic backend reads
    commands in the text ("error-after-2") and its audio is one frame per character, both of
    which normalisation would change; the tests of normalisation turn it on. Admission is
    ``fixed`` unless asked: the synthetic backend's pace is set by the test, not by a load, so
    a learned limit would measure nothing (tests/gateway/admission/test_capacity.py asks for it).
    The sentence audio cache is on, as by default, in a new directory of the run's own
    temporary directory (removed at the run's end; ``running_gateway`` removes its gateway's
    at once): in the user's state directory its entries would outlive the test and answer
    another's repeats, in this run or the next (the synthetic backend's model is one name)."""
    gateway.setdefault("admission", "fixed")
    return ServeConfig(
        device="cpu",
        gateway=GatewayConfig(**gateway),
        text=TextConfig(normalization="off"),
        cache=CacheConfig(dir=tempfile.mkdtemp(prefix="audio-cache-")),
    )


@asynccontextmanager
async def running_gateway(
    layout: InstanceLayout,
    *,
    backend: dict[str, Any] | None = None,
    serve: dict[str, Any] | None = None,
    tracing: Tracing | None = None,
    **gateway_cfg: Any,
) -> AsyncIterator[Harness]:
    """A gateway serving HTTP on a free port, with a synthetic backend behind it. The sentence
    audio cache is on, as by default, in a directory of this gateway's own (``serve_config``),
    removed at the end, unless the test names its own ``[cache]``."""
    if gateway_cfg.pop("zmq", False):
        gateway_cfg["zmq_endpoint"] = f"ipc://{layout.socket_dir}/zmq-clients"
    config = serve_config(**gateway_cfg)
    own_cache = config.cache.dir
    if serve:  # other sections of the configuration ([voices], [llm], ...)
        config = msgspec.structs.replace(config, **serve)
    if not config.cache.dir:  # a test's [cache] that names no directory: this gateway's
        config = msgspec.structs.replace(
            config, cache=msgspec.structs.replace(config.cache, dir=own_cache)
        )
    ep = layout.pcm_ring(0)
    create_ring(ep, RING_BYTES)
    be = SyntheticBackend(layout, **(backend or {})).start()
    gw = Gateway(config, layout, 0, GatewayMetrics(CollectorRegistry()), tracing)
    runner: web.AppRunner | None = None
    listener: Listener | None = None
    zmq_front: ZmqFrontend | None = None
    zmq_task: asyncio.Task[None] | None = None
    try:
        await gw.start()
        if config.gateway.zmq_endpoint:
            zmq_front = ZmqFrontend(gw, config.gateway.zmq_endpoint)
            zmq_task = asyncio.create_task(zmq_front.run())
        runner = app_runner(
            build_app(gw), config.gateway, **malformed_http.server_options(config.gateway)
        )
        await runner.setup()
        sock = reuseport_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        listener = await listen(runner, sock, config.gateway, gw.metrics)
        if be.status is not None and be.status.llm_ready:
            await wait_until(lambda: gw.readiness().ready, what="gateway ready")
        yield Harness(gw, be, config, layout, port, listener.guard)
    finally:
        if zmq_front is not None and zmq_task is not None:
            await zmq_front.close()
            zmq_task.cancel()
            await asyncio.gather(zmq_task, return_exceptions=True)
        if listener is not None:
            listener.close()
        if runner is not None:
            await runner.cleanup()
        await gw.close()
        be.stop()
        unlink_ring(ep)
        shutil.rmtree(own_cache, ignore_errors=True)


def pcm_seconds(n_bytes: int) -> float:
    return n_bytes / 2 / SAMPLE_RATE


async def garbage_of(
    traffic: Callable[[aiohttp.ClientSession], Awaitable[object]], settle_s: float
) -> list[Any]:
    """What ``traffic`` (clients on one session, e.g. ``bench.soak.clients.Soak.traffic``)
    leaves to the collector: everything it finds unreachable (``gc.DEBUG_SAVEALL``) once the
    traffic is over and the gateway's side of its last streams had ``settle_s`` to end."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            await traffic(session)
        await asyncio.sleep(settle_s)
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
