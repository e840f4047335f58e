"""Helpers for starting a server on this host: a free loopback port, and waiting for
``GET /ready`` (used by ``make demo``, the benchmarks and the end-to-end tests)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable


class NotReady(RuntimeError):
    """The server exited, or did not become ready in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it)."""
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
