"""The ZeroMQ direct protocol and its client library (sync and asyncio)."""

from __future__ import annotations

import asyncio
import io

import av
import msgspec
import pytest
import zmq
import zmq.asyncio
from gateway_harness import running_gateway, wait_until

from bench.doubles.synthetic_backend import synthetic_pcm
from gateway.zmq_client import AsyncClient, Client, SpeechError
from gateway.zmq_protocol import Error, server_decoder
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


async def test_sync_client_round_trip(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True) as h:
        endpoint = h.config.gateway.zmq_endpoint
        assert endpoint is not None

        def call() -> tuple[bytes, bytes]:
            with Client(endpoint, timeout_s=10) as c:
                pcm = b"".join(c.speech("Hello", voice="echo", max_tokens=70, seed=1))
                wav = b"".join(
                    c.speech("Hello", voice="tara", max_tokens=70, response_format="wav")
                )
            return pcm, wav

        pcm, wav = await asyncio.to_thread(call)
        assert pcm == pcm_for(10)
        with av.open(io.BytesIO(wav)) as f:
            assert sum(fr.samples for fr in f.decode(audio=0)) == 10 * 2048
        sub = h.backend.submitted()[0]
        assert sub.voice == "dan" and sub.sampling.seed == 1 and sub.sampling.max_tokens == 70
        assert h.metric("orpheus_gateway_requests_total", {"api": "zmq", "outcome": "ok"}) == 2


async def test_async_client_runs_concurrent_requests(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True, backend={"realtime": True}) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:

            async def one(frames: int) -> bytes:
                return b"".join([x async for x in c.speech("x", max_tokens=7 * frames)])

            lengths = [2 + i % 5 for i in range(20)]
            out = await asyncio.gather(*(one(n) for n in lengths))
        assert out == [pcm_for(n) for n in lengths]


async def test_async_incremental_text(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            async with c.stream("One. ", voice="tara") as s:
                await s.append("Two. ")
                await s.append("Three.", final=True)
                audio = b"".join([x async for x in s])
            assert s.done is not None and s.done.reason == "stop"
        assert audio == pcm_for(len("One. Two. Three."))
        assert h.backend.submitted()[0].text_open


async def test_errors_carry_http_statuses(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True, api_keys=["k"]) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        async with AsyncClient(ep) as c:
            with pytest.raises(SpeechError) as e:
                [x async for x in c.speech("hi")]
            assert e.value.status == 401
        async with AsyncClient(ep, api_key="k") as c:
            with pytest.raises(SpeechError) as e:
                [x async for x in c.speech("hi", voice="nobody")]
            assert (e.value.status, e.value.code) == (400, "bad_request")
            with pytest.raises(SpeechError) as e:
                [x async for x in c.speech("hi", speed=9.0)]
            assert (e.value.status, e.value.code) == (400, "invalid_request")  # as HTTP's
            with pytest.raises(SpeechError) as e:
                [x async for x in c.speech("")]
            assert e.value.code == "empty_input"
            assert b"".join([x async for x in c.speech("ok", max_tokens=14)]) == pcm_for(2)


async def test_cancel_and_vanished_client_stop_upstream(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True, backend={"realtime": True}) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        async with AsyncClient(ep) as c:
            async for _ in c.speech("long", max_tokens=7 * 200):
                break  # leaving the iteration early cancels the request
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")
        # A client that disappears without a word: the next send finds it gone.
        ctx = zmq.asyncio.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(ep)
        await raw.send(
            msgspec.msgpack.encode({"type": "speak", "request_id": 1, "input": "x" * 200})
        )
        await raw.recv()  # started
        await raw.recv()  # first audio
        raw.close(linger=0)
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 2, what="Cancel of the vanished")
        await wait_until(lambda: h.gateway.active_streams == 0, what="sessions closed")


async def test_malformed_messages_get_errors_and_the_server_keeps_serving(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout, zmq=True) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(ep)
        try:
            for frames in ([b"\xc1garbage"], [b"a", b"b"], [msgspec.msgpack.encode({"type": "nope"})],
                           [msgspec.msgpack.encode({"type": "append", "request_id": 9, "text": "x"})]):  # fmt: skip
                await raw.send_multipart(frames)
                reply = server_decoder.decode(await asyncio.wait_for(raw.recv(), 5))
                assert isinstance(reply, Error) and reply.status == 400
            await raw.send(msgspec.msgpack.encode({"type": "speak", "request_id": 4, "input": "x"}))
            await raw.send(msgspec.msgpack.encode({"type": "speak", "request_id": 4, "input": "x"}))
            kinds = []
            while "done" not in kinds:
                kinds.append(type(server_decoder.decode(await raw.recv())).__name__.lower())
            assert "error" in kinds  # the duplicate request id
        finally:
            raw.close(linger=0)
        async with AsyncClient(ep) as c:
            assert b"".join([x async for x in c.speech("ok", max_tokens=14)]) == pcm_for(2)
