"""A gateway in front of two vLLM engines (``llm.engines = 2``), with the synthetic backend
playing both engines' workers: streams land on both; every message of a stream (a ZeroMQ
text's appends, a WebSocket barge-in's cancel) reaches the engine its stream was placed on;
an engine's restart fails its streams only, and new streams avoid it until it is back."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
from elevenlabs_ws import Received, receive_until, ws_path
from gateway_harness import NO_STORE, running_gateway, wait_until

from orpheus_client.zmq_client import AsyncClient
from shm.layout import InstanceLayout
from shm.messages import ClusterStatus, EngineStatus
from testkit.synthetic_backend import ready_status

pytestmark = pytest.mark.timeout(60)


def two_engines(layout: InstanceLayout) -> InstanceLayout:
    return msgspec.structs.replace(layout, engines=2)


def body(text: str = "Hello there.") -> dict[str, str]:
    return {"model": "orpheus", "input": text, "voice": "tara", "response_format": "pcm"}


async def test_streams_land_on_both_engines(layout: InstanceLayout) -> None:
    lay = two_engines(layout)
    backend = {"realtime": True, "first_chunk_delay_s": 0.3}
    async with running_gateway(lay, backend=backend) as h, aiohttp.ClientSession() as s:
        responses = await asyncio.gather(
            *(s.post(f"{h.url}/v1/audio/speech", json=body(), headers=NO_STORE) for _ in range(4))
        )
        for r in responses:
            assert r.status == 200
            await r.read()
        engines = [next(iter(h.backend.engine_of[m.stream_id])) for m in h.backend.submitted()]
        assert sorted(engines) == [0, 0, 1, 1]
        assert all(len(e) == 1 for e in h.backend.engine_of.values())
        placed = {
            e: h.metric("orpheus_gateway_engine_active_streams", {"engine": str(e)}) for e in (0, 1)
        }
        assert placed == {0: 0.0, 1: 0.0}, "every placed stream was released on its engine"


async def test_appends_and_cancels_reach_the_streams_engine(layout: InstanceLayout) -> None:
    lay = two_engines(layout)
    async with running_gateway(lay, zmq=True) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            # Two texts open at once: the second is placed on the other engine.
            async with c.stream("One. ", voice="tara") as a, c.stream("Un. ", voice="tara") as b:
                for st in (a, b):
                    await st.append("Two. ")
                for st in (a, b):
                    await st.append("Three.", final=True)
                    _ = [x async for x in st]
        submits = h.backend.submitted()
        assert len(submits) == 2
        assert {next(iter(h.backend.engine_of[m.stream_id])) for m in submits} == {0, 1}
        for m in submits:
            assert len(h.backend.engine_of[m.stream_id]) == 1, "appends went to another engine"


async def test_a_websocket_barge_in_cancels_on_the_units_engine(layout: InstanceLayout) -> None:
    lay = two_engines(layout)
    async with (
        running_gateway(lay, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        # Engine 0 is busy with one stream, so the WebSocket's unit is placed on engine 1.
        busy = asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body("A. " * 40)))
        await wait_until(lambda: len(h.backend.submitted()) == 1, what="the first stream")
        async with s.ws_connect(h.url + ws_path()) as ws:
            r = Received()
            await ws.send_json({"text": " ", "context_id": "turn1"})
            await ws.send_json(
                {"text": "This is a long answer that the user will cut. ", "context_id": "turn1"}
            )
            await receive_until(ws, r, lambda: len(r.audio["turn1"]) > 0)
            await ws.send_json({"context_id": "turn1", "close_context": True})  # barge-in
            await receive_until(ws, r, lambda: "turn1" in r.final)
            unit = h.backend.submitted()[1].stream_id
            await wait_until(lambda: unit in h.backend.cancelled_ids(), what="Cancel upstream")
            assert h.backend.engine_of[unit] == {1}
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)


async def test_an_engine_restart_fails_only_its_streams(layout: InstanceLayout) -> None:
    lay = two_engines(layout)
    backend = {"realtime": True, "first_chunk_delay_s": 30.0}
    async with running_gateway(lay, backend=backend) as h, aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body(), headers=NO_STORE))
            for _ in range(2)
        ]
        await wait_until(lambda: len(h.backend.submitted()) == 2, what="two streams")
        on_engine = {next(iter(h.backend.engine_of[m.stream_id])): m for m in h.backend.submitted()}
        # Engine 1's worker died: its stream fails with a clear error, engine 0's goes on.
        h.backend.status = ClusterStatus(
            engines=(EngineStatus(True), EngineStatus(False, generation=1)),
            codec_ready=True,
            draining=False,
        )
        done, pending = await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pending) == 1
        r = done.pop().result()
        assert r.status == 503 and (await r.json())["error"]["code"] == "worker_restarted"
        gone = on_engine[1].stream_id
        await wait_until(lambda: gone in h.backend.cancelled_ids(), what="the Cancel upstream")
        assert on_engine[0].stream_id not in h.backend.cancelled_ids()
        async with s.get(f"{h.url}/ready") as ready:
            assert ready.status == 200, "one ready engine keeps the node ready"
            state = await ready.json()
            assert state["max_active_streams"] == h.gateway.admission.per_engine
        # New streams avoid the dead engine.
        third = asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body()))
        await wait_until(lambda: len(h.backend.submitted()) == 3, what="a third stream")
        assert h.backend.engine_of[h.backend.submitted()[2].stream_id] == {0}
        h.backend.status = ready_status(2)  # engine 1 is back
        for t in (*pending, third):
            t.cancel()
        await asyncio.gather(*pending, third, return_exceptions=True)


def test_the_ready_body_counts_engines() -> None:
    """The node is ready while one engine is; its reasons name the engines when none is."""
    from gateway.admission.readiness import readiness

    none = ClusterStatus(
        engines=(EngineStatus(False), EngineStatus(False)), codec_ready=True, draining=False
    )
    r = readiness(none, False, (0, 0), 4)
    assert not r.ready and "none of the 2 llm engines ready" in r.reasons
    assert json.loads(msgspec.json.encode(r))["ready"] is False
