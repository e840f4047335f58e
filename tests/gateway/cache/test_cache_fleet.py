"""The sentence audio cache's fleet backend (``cache.fleet_url``) against a real server:
Debian's ``redis-server`` (Redis 7.0, the protocol Valkey keeps), started by the test on a
loopback port and stopped by it. Two nodes (two gateways, each its own cache directory)
share hits through it; a server stopped mid-run fails no request."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from gateway_harness import Harness, running_gateway, wait_until

from common.config.cache import CacheConfig
from shm.layout import InstanceLayout
from testkit.local_server import free_port

pytestmark = pytest.mark.timeout(90)

TEXT = "Thank you for calling, how can I help you today?"


class Valkey:
    """A redis-server on a free loopback port, no persistence, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[Valkey]:
    (tmp_path / "valkey").mkdir()
    server = Valkey(tmp_path / "valkey")
    yield server
    server.stop()


def _node(tmp_path: Path, name: str, url: str) -> dict[str, object]:
    return {"cache": CacheConfig(enabled=True, dir=str(tmp_path / name), fleet_url=url)}


async def _speak(h: Harness, s: aiohttp.ClientSession) -> tuple[str | None, bytes]:
    body = {"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "pcm"}
    async with s.post(
        h.url + "/v1/audio/speech", json=body, headers={"Authorization": "Bearer k1"}
    ) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("X-Cache"), await r.read()


async def test_two_nodes_share_hits_through_the_fleet(
    layout: InstanceLayout, tmp_path: Path, valkey: Valkey
) -> None:
    async with (
        running_gateway(layout, serve=_node(tmp_path, "a", valkey.url), api_keys=["k1"]) as a,
        aiohttp.ClientSession() as s,
    ):
        await _speak(a, s)
        _, stored = await _speak(a, s)
        await wait_until(lambda: a.metric("orpheus_gateway_cache_stores_total") >= 1)
        await asyncio.sleep(0.3)  # its copy to the fleet
    # Another node (its own directory, empty): its first request is a hit from the fleet,
    # then the entry is its own.
    async with (
        running_gateway(layout, serve=_node(tmp_path, "b", valkey.url), api_keys=["k1"]) as b,
        aiohttp.ClientSession() as s,
    ):
        assert await _speak(b, s) == ("hit", stored)
        assert b.metric("orpheus_gateway_cache_fleet_hits_total") == 1
        assert not b.backend.submitted()
        await wait_until(lambda: bool(list((tmp_path / "b").glob("*/*.pcm"))), what="copied")
        assert await _speak(b, s) == ("hit", stored)
        assert b.metric("orpheus_gateway_cache_fleet_hits_total") == 1  # the node's own now


async def test_a_fleet_server_stopped_mid_run_fails_no_request(
    layout: InstanceLayout, tmp_path: Path, valkey: Valkey
) -> None:
    async with (
        running_gateway(layout, serve=_node(tmp_path, "a", valkey.url), api_keys=["k1"]) as h,
        aiohttp.ClientSession() as s,
    ):
        await _speak(h, s)
        valkey.stop()
        for _ in range(4):  # the node's own cache answers alone
            state, audio = await _speak(h, s)
            assert state in ("miss", "hit") and audio
        await wait_until(lambda: h.metric("orpheus_gateway_cache_stores_total") >= 1)
        assert (await _speak(h, s))[0] == "hit"
        assert h.gateway.cache is not None and h.gateway.cache.fleet is not None
        assert h.gateway.cache.fleet.failures >= 1
