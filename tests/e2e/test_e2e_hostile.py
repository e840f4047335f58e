"""Hostile and careless clients against the real server (tiny model on CPU, loopback):
half-open HTTP requests and a WebSocket left with an open utterance are closed by the
gateway's timeouts, after which vLLM runs nothing, the gateway process's descriptors are
back to their level and a normal request is served (issue 27; the gateway's own tests with
every front end and limit are in test_gateway_hostile.py)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from e2e_harness import Server, child_pid, start_server, stop_server

pytestmark = pytest.mark.timeout(300)
SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "tara", "response_format": "pcm",
          "max_tokens": 70}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    srv = start_server(
        tiny_model,
        "--set", "gateway.header_timeout_s=1",
        "--set", "gateway.body_timeout_s=2",
        "--set", "gateway.ws_text_idle_timeout_s=1",
    )  # fmt: skip
    yield srv
    stop_server(srv)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def wait_for(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def test_half_open_requests_and_an_open_utterance_leave_nothing_held(server: Server) -> None:
    gateway = child_pid(server.proc.pid, "gateway")
    port = int(server.url.rsplit(":", 1)[1])

    async def run() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/v1/audio/speech", json=SPEECH) as r,
        ):
            assert r.status == 200
            await r.read()
        await asyncio.sleep(0.5)
        fds = open_fds(gateway)
        body = json.dumps(SPEECH).encode()
        partial = [
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10],
        ]  # fmt: skip
        conns = []
        for i in range(60):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(partial[i % 2])
            conns.append((reader, writer))
        async with aiohttp.ClientSession() as s:
            sockets = []
            for _ in range(5):
                ws = await s.ws_connect(server.url + "/v1/audio/speech/stream")
                await ws.send_json({"type": "session.config", "voice": "tara",
                                    "response_format": "pcm", "stream_audio": True})  # fmt: skip
                await ws.send_json({"type": "input.text", "text": "Hi. And then"})
                sockets.append(ws)
            answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 20) for r, _ in conns))
            assert all(a.startswith(b"HTTP/1.1 408") for a in answers)
            for ws in sockets:
                codes = []
                async for msg in ws:  # audio for "Hi.", then the idle timeout closes it
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        codes.append(json.loads(msg.data).get("code"))
                assert codes[-1] == "timeout", codes
        for _, w in conns:
            w.close()
        await wait_for(lambda: server.metric("vllm:num_requests_running") == 0, 30, "vLLM idle")
        await wait_for(
            lambda: server.metric("orpheus_gateway_active_streams") == 0, 30, "no stream"
        )
        await wait_for(lambda: open_fds(gateway) <= fds, 30, "descriptors back")
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/v1/audio/speech", json=SPEECH) as r,
        ):
            assert r.status == 200 and len(await r.read()) > 0

    asyncio.run(run())
