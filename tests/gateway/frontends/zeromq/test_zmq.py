"""The ZeroMQ direct protocol and its client library (sync and asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import av
import msgspec
import pytest
import zmq
import zmq.asyncio
from gateway_harness import running_gateway, wait_until

from common.config.text import TextConfig
from gateway.frontends.zeromq.server import MAX_PENDING_APPENDS
from orpheus_client.zmq_client import AsyncClient, Client, SpeechError
from orpheus_wire.zeromq import (
    Audio,
    Done,
    Error,
    ServerMessage,
    Started,
    server_decoder,
)
from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

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


async def test_say_zmq_speaks_through_the_client_library(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """``orpheus-serve say --zmq`` (the command, in its own process) reaches the gateway
    through ``orpheus_client.zmq_client``, outside the server package."""
    async with running_gateway(layout, zmq=True) as h:
        out = tmp_path / "say.wav"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orpheus_serve", "say", "Hello", "--zmq",
            h.config.gateway.zmq_endpoint or "", "--max-tokens", "70", "-o", str(out),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        stdout, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, stdout.decode()[-2000:]
        with wave.open(str(out)) as w:
            assert w.readframes(w.getnframes()) == pcm_for(10)
        assert h.metric("orpheus_gateway_requests_total", {"api": "zmq", "outcome": "ok"}) == 1


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
    async with running_gateway(layout, zmq=True, backend={"realtime": True}) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(ep)
        try:
            for frames in ([b"\xc1garbage"], [b"a", b"b"], [msgspec.msgpack.encode({"type": "nope"})],
                           [msgspec.msgpack.encode({"type": "append", "request_id": 9, "text": "x"})]):  # fmt: skip
                await raw.send_multipart(frames)
                reply = server_decoder.decode(await asyncio.wait_for(raw.recv(), 5))
                assert isinstance(reply, Error) and reply.status == 400
            # A request that plays in real time is surely still open when its id comes again
            # (a short one may have ended first on a loaded machine: then the id is free).
            speak = {"type": "speak", "request_id": 4, "input": "x" * 200}
            await raw.send(msgspec.msgpack.encode(speak))
            assert isinstance(await _next(raw), Started)
            await raw.send(msgspec.msgpack.encode(speak))
            replies = []
            while not replies or not isinstance(replies[-1], Error):
                replies.append(await _next(raw))
            assert (replies[-1].request_id, replies[-1].code) == (4, "duplicate_request_id")
            assert all(isinstance(r, Audio) for r in replies[:-1])
            # The first request is untouched by its refused twin: it plays on until cancelled.
            await raw.send(msgspec.msgpack.encode({"type": "cancel", "request_id": 4}))
            while not isinstance(last := await _next(raw), Done | Error):
                assert isinstance(last, Audio)
        finally:
            raw.close(linger=0)
        async with AsyncClient(ep) as c:
            assert b"".join([x async for x in c.speech("ok", max_tokens=14)]) == pcm_for(2)


# -- the one-answer rule under careless clients (issue 25) -----------------------------------


def _msg(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


async def _next(sock: zmq.asyncio.Socket, timeout_s: float = 5.0) -> ServerMessage:
    return server_decoder.decode(await asyncio.wait_for(sock.recv(), timeout_s))


async def _silent(sock: zmq.asyncio.Socket, seconds: float) -> bool:
    return not await sock.poll(int(seconds * 1000), zmq.POLLIN)


@contextlib.asynccontextmanager
async def _dealer(endpoint: str) -> AsyncIterator[zmq.asyncio.Socket]:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


@contextlib.asynccontextmanager
async def _slot_taken(endpoint: str) -> AsyncIterator[None]:
    """The only stream slot held by an open text (the next requests wait in the queue)."""
    async with _dealer(endpoint) as holder:
        await holder.send(_msg(type="speak", request_id=1, input="", text_open=True))
        assert isinstance(await _next(holder), Started)
        yield


@pytest.mark.parametrize("trouble", ["too_many_appends", "text_not_a_string"])
async def test_a_queued_request_refused_for_its_messages_is_answered(
    layout: InstanceLayout, trouble: str
) -> None:
    async with running_gateway(layout, zmq=True, max_active_streams=1) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        async with _slot_taken(ep), _dealer(ep) as raw:
            await raw.send(_msg(type="speak", request_id=7, input="Hi ", text_open=True))
            if trouble == "too_many_appends":
                for _ in range(MAX_PENDING_APPENDS + 1):
                    await raw.send(_msg(type="append", request_id=7, text="more "))
            else:
                await raw.send(_msg(type="append", request_id=7, text=12))
            reply = await _next(raw)
            assert isinstance(reply, Error) and (reply.request_id, reply.status) == (7, 400)
            assert reply.code == (
                "too_many_messages" if trouble == "too_many_appends" else "invalid_message"
            )
            assert await _silent(raw, 0.3)  # one answer, and the request is gone
            await raw.send(_msg(type="cancel", request_id=7))
            assert (await _next(raw)).code == "unknown_request"  # type: ignore[union-attr]
        assert h.backend.submitted() and len(h.backend.submitted()) == 1


async def test_deeply_nested_messages_are_answered(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture
) -> None:
    nested = b"\x91" * 50_000 + b"\xc0"  # 50,000 arrays, each holding the next
    async with running_gateway(layout, zmq=True) as h, _dealer(h.config.gateway.zmq_endpoint or "") as raw:  # fmt: skip
        in_field = _msg(type="append", request_id=3, text="")[:-1] + nested
        for payload in (nested, in_field, b"\x81\xa5extra" + nested):
            await raw.send(payload)
            reply = await _next(raw)
            assert isinstance(reply, Error) and (reply.status, reply.code) == (
                400,
                "invalid_message",
            )
            assert reply.request_id is None
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            assert b"".join([x async for x in c.speech("ok", max_tokens=14)]) == pcm_for(2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_open_text_left_idle_times_out_and_frees_its_slot(layout: InstanceLayout) -> None:
    async with running_gateway(
        layout, zmq=True, max_active_streams=1, zmq_text_idle_timeout_s=0.6
    ) as h, _dealer(h.config.gateway.zmq_endpoint or "") as raw:  # fmt: skip
        # Appends keep an open text alive ...
        await raw.send(_msg(type="speak", request_id=1, input="One. ", text_open=True))
        assert isinstance(await _next(raw), Started)
        for _ in range(4):
            await asyncio.sleep(0.3)
            await raw.send(_msg(type="append", request_id=1, text="More. "))
        await raw.send(_msg(type="append", request_id=1, text="End.", final=True))
        kinds = [
            type(await _next(raw)) for _ in range(len("One. More. More. More. More. End.") + 1)
        ]
        assert kinds[-1] is Done and set(kinds[:-1]) == {Audio}
        # ... one the client forgets ends with an error that says so, and frees the slot.
        await raw.send(_msg(type="speak", request_id=2, input="Two. ", text_open=True))
        assert isinstance(await _next(raw), Started)
        while isinstance(reply := await _next(raw, 3.0), Audio):
            pass
        assert isinstance(reply, Error) and (reply.request_id, reply.status) == (2, 408)
        assert reply.code == "timeout" and "final" in reply.message
        await wait_until(lambda: h.gateway.active_streams == 0, what="the slot freed")
        # The Cancel crosses a ZeroMQ socket to the backend's thread: wait for it there.
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")


@pytest.mark.parametrize("limit", [2048, 64 * 1024])
async def test_frames_over_the_size_limit_are_never_read(
    layout: InstanceLayout, limit: int
) -> None:
    async with running_gateway(
        layout, zmq=True, zmq_max_message_bytes=limit
    ) as h, _dealer(h.config.gateway.zmq_endpoint or "") as raw:  # fmt: skip
        big = _msg(type="speak", request_id=1, input="x" * 3000, max_tokens=14)
        await raw.send(big)
        if limit < len(big):  # the connection is dropped before the frame is read
            assert await _silent(raw, 1.0)
            assert not h.backend.submitted()
        else:
            assert isinstance(await _next(raw), Started)
        # The DEALER reconnects by itself; a message within the limit is served.
        await raw.send(_msg(type="speak", request_id=2, input="ok", max_tokens=14))
        while not isinstance(reply := await _next(raw), Done | Error) or reply.request_id != 2:
            pass
        assert isinstance(reply, Done)


# Open text without a sentence end: every character the client sends counts against
# gateway.max_input_chars when it arrives, whether the server sends it on, holds it back
# (normalisation and dictionaries hold the last words of an append) or holds the whole
# append while the request waits for admission.
NO_SENTENCE_END = ["x" * 100, "word " * 20]


@pytest.mark.parametrize("piece", NO_SENTENCE_END, ids=["one_word", "words"])
@pytest.mark.parametrize("normalization", ["on", "off"])
async def test_open_text_past_the_limit_ends_with_input_too_long(
    layout: InstanceLayout, piece: str, normalization: str
) -> None:
    async with running_gateway(
        layout,
        zmq=True,
        max_input_chars=400,
        serve={"text": TextConfig(normalization=normalization)},  # what "auto" means
    ) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            async with c.stream(voice="tara") as s:
                for _ in range(4):  # 400 characters: within the limit
                    await s.append(piece)
                with pytest.raises(SpeechError) as e:
                    await s.append(piece)  # 500
                    async with asyncio.timeout(5):
                        _ = [x async for x in s]
            assert (e.value.status, e.value.code) == (400, "input_too_long")
            assert "500 characters; the limit is 400" in str(e.value)
        await wait_until(lambda: h.gateway.active_streams == 0, what="the slot freed")


@pytest.mark.parametrize("normalization", ["on", "off"])
async def test_raw_open_text_past_the_limit_and_after(
    layout: InstanceLayout, normalization: str
) -> None:
    async with running_gateway(
        layout, zmq=True, max_input_chars=100
    ) as h, _dealer(h.config.gateway.zmq_endpoint or "") as raw:  # fmt: skip
        await raw.send(
            _msg(
                type="speak", request_id=1, input="x" * 10, text_open=True,
                apply_text_normalization=normalization,
            )
        )  # fmt: skip
        assert isinstance(await _next(raw), Started)
        for _ in range(4):  # 110 characters
            await raw.send(_msg(type="append", request_id=1, text="y" * 25))
        while isinstance(reply := await _next(raw), Audio):  # "off": what was sent on is spoken
            pass
        assert isinstance(reply, Error), reply
        assert (reply.request_id, reply.status, reply.code) == (1, 400, "input_too_long")
        assert "110 characters; the limit is 100" in reply.message
        # Later appends hold nothing: the request is gone.
        for _ in range(3):
            await raw.send(_msg(type="append", request_id=1, text="z" * 25))
            assert (await _next(raw)).code == "unknown_request"  # type: ignore[union-attr]
        await wait_until(lambda: h.gateway.active_streams == 0, what="the slot freed")


async def test_open_text_past_the_limit_while_queued(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True, max_active_streams=1, max_input_chars=4096) as h:
        ep = h.config.gateway.zmq_endpoint or ""
        async with _slot_taken(ep), _dealer(ep) as raw:
            await raw.send(
                _msg(type="speak", request_id=7, input="Hi ", text_open=True,
                     apply_text_normalization="on")
            )  # fmt: skip
            for _ in range(5):
                await raw.send(_msg(type="append", request_id=7, text="x" * 1000))
            reply = await _next(raw)
            assert isinstance(reply, Error) and (reply.request_id, reply.status) == (7, 400)
            assert reply.code == "input_too_long" and "5003 characters" in reply.message
            assert await _silent(raw, 0.3)
        assert len(h.backend.submitted()) == 1  # the slot holder's only
