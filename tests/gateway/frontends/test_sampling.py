"""The sampling fields (``orpheus_wire.sampling.SamplingFields``) reach the llm_worker's
``LlmSubmit`` from every front end that carries them: OpenAI HTTP, ZeroMQ (through the client
library), vLLM-Omni's ``session.config``, Baseten's WebSocket and HTTP, long-form jobs.
``top_k``, the field added last, proves the path: declared once, it travels everywhere.
Against the gateway with its synthetic backend (tests/harness/gateway_harness.py); the engine side
(``SamplingParams.top_k``) is tests/llm/test_requests.py and, through a real engine,
tests/llm/test_worker_process.py (``test_top_k_reaches_vllm``)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from gateway_harness import Harness, running_gateway, wait_until

from common.config.jobs import JobsConfig
from orpheus_client.zmq_client import AsyncClient
from shm.layout import InstanceLayout
from shm.messages import LlmSubmit

pytestmark = pytest.mark.timeout(60)

SAMPLING = {"top_k": 1, "temperature": 0.5, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 4}


async def _submitted(h: Harness, n: int) -> list[LlmSubmit]:
    await wait_until(lambda: len(h.backend.submitted()) >= n, what=f"{n} submits")
    return h.backend.submitted()


def _assert_sampling(sub: LlmSubmit, *, length: int | None = None) -> None:
    o = sub.sampling
    got = {k: getattr(o, k) for k in SAMPLING}
    assert got == SAMPLING, got
    assert o.max_tokens == length


async def test_openai_http(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        body = {"model": "tts-1", "input": "Hi.", "voice": "tara", "response_format": "pcm",
                "max_tokens": 70, **SAMPLING}  # fmt: skip
        async with s.post(h.url + "/v1/audio/speech", json=body) as r:
            assert r.status == 200 and await r.read()
        [sub] = await _submitted(h, 1)
        _assert_sampling(sub, length=70)


async def test_zeromq_through_the_client_library(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            audio = [a async for a in c.speech("Hi.", voice="tara", max_tokens=70, **SAMPLING)]
        assert audio
        [sub] = await _submitted(h, 1)
        _assert_sampling(sub, length=70)


async def test_the_client_library_refuses_a_name_speak_has_not() -> None:
    c = AsyncClient("ipc:///nonexistent")
    with pytest.raises(TypeError, match="top_kk"):
        c.stream("Hi.", top_kk=1)


async def test_vllm_omni_session_config(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session.config", "voice": "tara",
                                "response_format": "pcm", "max_tokens": 70, **SAMPLING})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Hi. Bye."})
            await ws.send_json({"type": "input.done"})
            while True:
                msg = await ws.receive(10)
                assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
                if msg.type == aiohttp.WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    assert ev["type"] != "error", ev
                    if ev["type"] == "session.done":
                        break
        subs = await _submitted(h, 1)
        for sub in subs:  # every unit of the stream, max_tokens ignored (each has its own)
            _assert_sampling(sub, length=None)


async def test_baseten_websocket(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + "/v1/baseten/orpheus/websocket") as ws:
            await ws.send_json({"voice": "tara", "max_tokens": 2000, **SAMPLING})
            await ws.send_str("Hi.")
            await ws.send_str("__END__")
            while (msg := await ws.receive(10)).type == aiohttp.WSMsgType.BINARY:
                pass
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
            assert ws.close_code == 1000, ws.close_code
        [sub] = await _submitted(h, 1)
        _assert_sampling(sub, length=None)  # Baseten's max_tokens is a cap, not a length


async def test_baseten_predict(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        body = {"prompt": "Hi.", "voice": "tara", "max_tokens": 2000, **SAMPLING}
        async with s.post(h.url + "/v1/baseten/orpheus/predict", json=body) as r:
            assert r.status == 200 and await r.read()
        [sub] = await _submitted(h, 1)
        _assert_sampling(sub, length=None)


async def test_long_form_job(layout: InstanceLayout, tmp_path: Path) -> None:
    jobs = JobsConfig(dir=str(tmp_path / "jobs"), poll_s=0.05)
    async with (
        running_gateway(layout, serve={"jobs": jobs}, max_active_streams=16) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "tts-1", "input": "Hi.", "voice": "tara", "response_format": "pcm",
                **SAMPLING}  # fmt: skip
        async with s.post(h.url + "/v1/audio/jobs", json=body) as r:
            assert r.status == 202, await r.text()
            job = await r.json()
        [sub] = await _submitted(h, 1)
        _assert_sampling(sub, length=None)
        async with s.get(h.url + f"/v1/audio/jobs/{job['id']}") as r:
            assert r.status == 200
        await wait_until(lambda: h.gateway.active_streams == 0, what="the unit finished")
