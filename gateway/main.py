"""Entry point of a gateway process: ``run(config, layout, index)`` (see orchestrator.child).

aiohttp on uvloop, listening with SO_REUSEPORT so that several gateway processes share one
port (the kernel spreads connections across them). Reports ``WorkerReady`` to the
orchestrator once listening and a ``Heartbeat`` every second. SIGTERM drains (no new
streams, active ones finish within ``drain_timeout_s``); SIGINT, a second SIGTERM, or the
SIGTERM that the orchestrator's death sends stops at once. Never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket

import uvloop
from prometheus_client import REGISTRY

from common.config import ServeConfig
from common.link import WorkerLink
from common.tracing import setup_tracing
from gateway.app import build_app
from gateway.edge import malformed_http
from gateway.edge.listener import app_runner, listen
from gateway.frontends.zeromq.server import ZmqFrontend
from gateway.metrics import GatewayMetrics
from gateway.service import Gateway
from orpheus_wire.zeromq import endpoint_for
from shm.layout import InstanceLayout

log = logging.getLogger(__name__)

FIRST_STATUS_TIMEOUT_S = 10.0
LISTEN_BACKLOG = 4096


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other gateway processes can bind too (SO_REUSEPORT)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def raise_fd_limit() -> int:
    """Lift the soft open-file limit to the hard one: each client holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


class GatewayBroken(RuntimeError):
    """A background task the gateway cannot serve without ended (the message says which)."""


def role_name(index: int) -> str:
    return f"gateway-{index}"


async def serve(config: ServeConfig, layout: InstanceLayout, index: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fast = asyncio.Event()

    parent = os.getppid()

    def on_term() -> None:
        # A second SIGTERM, or the one the kernel sends when the orchestrator dies
        # (PR_SET_PDEATHSIG, orchestrator/child.py): with the orchestrator gone the workers
        # die too, so nothing in flight can finish and draining would only wait.
        if stop.is_set() or os.getppid() != parent:
            fast.set()
        stop.set()

    def on_int() -> None:
        fast.set()
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_int)

    g = config.gateway
    tracing = setup_tracing("gateway", config.otlp_traces_endpoint)
    gateway = Gateway(config, layout, index, GatewayMetrics(REGISTRY), tracing)
    await gateway.start()
    runner = app_runner(
        build_app(gateway),
        g,
        access_log=logging.getLogger("gateway.access") if g.access_log else None,
        **malformed_http.server_options(g),
    )
    await runner.setup()
    zmq_front: ZmqFrontend | None = None
    zmq_task: asyncio.Task[None] | None = None
    if g.zmq_endpoint:
        zmq_front = ZmqFrontend(gateway, endpoint_for(g.zmq_endpoint, index))
        zmq_task = asyncio.create_task(zmq_front.run(), name="zmq-frontend")

    role = role_name(index)
    link = WorkerLink(layout.orch, role)
    # Ready means able to serve: wait for the orchestrator's first ClusterStatus (it publishes
    # one every 0.5 s) so that the first request is not refused for want of it.
    if not await gateway.cluster.wait_first(FIRST_STATUS_TIMEOUT_S):
        log.warning("no ClusterStatus after %.0f s; reporting ready anyway", FIRST_STATUS_TIMEOUT_S)
    # Only now on the shared port: bound earlier, with another gateway process serving it,
    # the kernel would hand this one connections it refuses (503 workers_not_ready).
    listener = await listen(runner, reuseport_socket(g.host, g.port), g, gateway.metrics)
    link.ready(f"http://{g.host}:{g.port}")
    log.info("%s listening on %s:%d (pid %d)", role, g.host, g.port, link.pid)
    beat = asyncio.create_task(link.beat_forever(lambda: gateway.active_streams), name="heartbeat")
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopped, gateway.broken}, return_when=asyncio.FIRST_COMPLETED)
        if gateway.broken.done():
            # Nothing in flight can finish: fail it now (no drain), then exit with the cause.
            raise GatewayBroken(gateway.broken.result())
        gateway.begin_drain()
        drain = asyncio.create_task(gateway.drain(config.drain_timeout_s))
        fast_wait = asyncio.create_task(fast.wait())
        await asyncio.wait({drain, fast_wait}, return_when=asyncio.FIRST_COMPLETED)
        fast_wait.cancel()
        if not drain.done():
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
    finally:
        log.info("%s stopping", role)
        stopped.cancel()
        beat.cancel()
        if zmq_front is not None and zmq_task is not None:
            await zmq_front.close()
            zmq_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await zmq_task
        listener.close()
        await gateway.close()
        await runner.cleanup()
        link.close()
        if tracing is not None:
            await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)


def run(config: ServeConfig, layout: InstanceLayout, index: int) -> None:
    """Serve until SIGTERM (drain) or SIGINT (stop now)."""
    raise_fd_limit()
    uvloop.run(serve(config, layout, index))
