"""Helpers for starting a server on this host: a free loopback port, and waiting for
``GET /ready`` (used by ``make demo``, the benchmarks and the end-to-end tests)."""

from __future__ import annotations

import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


class NotReady(RuntimeError):
    """The server exited, or did not become ready in time."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 12_000
"""How many ports under the kernel's ephemeral range :func:`free_port` picks from."""
_handed_out: set[int] = set()
_pick = random.SystemRandom()


def _ephemeral_low() -> int | None:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range where there is one.

    A port the kernel picks (``bind(("127.0.0.1", 0))``) is an ephemeral one: in the seconds
    between this call and the server's own bind (a server binds its HTTP port only once its
    engine is ready), any outgoing connection on the host may take it as its local port, or
    another process's ``bind(0)`` may, and the server then stops with "port in use" (exit 78).
    Below the range only a listener someone placed there takes a port, and this checks there
    is none. Two processes may still draw the same port; one process never hands it out twice.
    """
    low = _ephemeral_low()
    if low is not None and low > 1024 + BELOW_EPHEMERAL:
        for _ in range(64):
            port = _pick.randrange(low - BELOW_EPHEMERAL, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_ready(url: str) -> bool:
    """Whether ``GET {url}/ready`` answers 200 now."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/ready", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_ready(
    url: str,
    exited: Callable[[], int | None],
    timeout_s: float,
    *,
    interval_s: float = 0.5,
) -> float:
    """Poll ``/ready`` until it answers 200; returns the seconds waited.

    ``exited`` is polled too (``Popen.poll``): the wait stops at once if the server exits.
    Raises ``NotReady`` on exit or timeout.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        code = exited()
        if code is not None:
            raise NotReady(f"the server exited with {code} before it was ready")
        if is_ready(url):
            return time.monotonic() - t0
        time.sleep(interval_s)
    raise NotReady(f"the server was not ready after {timeout_s:.0f}s")
