"""The ZeroMQ front end's one-answer rule, over generated message sequences (hypothesis).

docs/api.md: every request ends with exactly one ``done`` or ``error`` (none after the
client's own ``cancel`` while it was still queued), and a message that cannot be decoded is
answered with an ``error`` whose ``request_id`` is null. One gateway (synthetic backend,
two stream slots, a short queue, short open-text and queue timeouts) serves every example;
each example is a fresh DEALER that sends a generated sequence of speaks (complete or open
text, some invalid), appends (some whose text is not a string, some final, some past the
pending limit), cancels, undecodable messages (garbage, several frames, deep nesting) and
pauses, then reads until every request has ended. Whether a message finds its request
still open depends on timing, so the checks are those that hold for every timing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq
import zmq.asyncio
from gateway_harness import Harness, running_gateway, wait_until
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gateway.frontends.zeromq import server as zmq_server
from orpheus_wire.zeromq import (
    Audio,
    Done,
    Error,
    ServerMessage,
    Started,
    server_decoder,
)
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 25
EXAMPLE_TIMEOUT_S = 20.0
QUIET_S = 0.4
"""After the last expected answer, how long nothing more may arrive."""
UNKNOWN_RID = 1_000_000
PENDING_LIMIT = 3
"""``MAX_PENDING_APPENDS`` for this test, so that sequences of a few appends pass it."""
REFUSALS = {"unknown_request", "invalid_message"}
"""Codes of an error that answers one message about a request that had already ended."""

NESTED = b"\x91" * 5000 + b"\xc0"


def _pack(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


JUNK: dict[str, list[bytes]] = {
    "garbage": [b"\xc1garbage"],
    "two_frames": [_pack(type="cancel", request_id=1), b"x"],
    "not_a_map": [_pack(x=1)[1:]],
    "unknown_type": [_pack(type="nope")],
    "rid_not_an_int": [_pack(type="cancel", request_id="1")],
    "nested": [NESTED],
    "nested_before_the_tag": [b"\x82\xa5extra" + NESTED + b"\xa4type\xa6cancel"],
}
"""Messages with no request_id the gateway can read: each is answered with request_id null."""


@dataclass(frozen=True)
class Speak:
    text_open: bool
    variant: str  # ok, bad_voice, bad_speed
    frames: int


@dataclass(frozen=True)
class Append:
    target: int  # the n-th speak of the sequence (modulo), or an unknown rid if none yet
    text: str | int
    final: bool


@dataclass(frozen=True)
class CancelOp:
    target: int


@dataclass(frozen=True)
class AddressedJunk:
    """A message naming a request that fails validation (it ends that request if open)."""

    target: int


@dataclass(frozen=True)
class Junk:
    kind: str


@dataclass(frozen=True)
class Pause:
    seconds: float


Op = Speak | Append | CancelOp | AddressedJunk | Junk | Pause

ops_strategy = st.lists(
    st.one_of(
        st.builds(
            Speak,
            st.booleans(),
            st.sampled_from(["ok", "ok", "ok", "bad_voice", "bad_speed"]),
            st.integers(1, 6),
        ),
        st.builds(
            Append,
            st.integers(-1, 5),
            st.one_of(st.sampled_from(["More. ", "", "Yes"]), st.integers(0, 9)),
            st.booleans(),
        ),
        st.builds(CancelOp, st.integers(-1, 5)),
        st.builds(AddressedJunk, st.integers(-1, 5)),
        st.builds(Junk, st.sampled_from(sorted(JUNK))),
        st.builds(Pause, st.sampled_from([0.01, 0.05, 0.2])),
    ),
    min_size=1,
    max_size=14,
)


@dataclass
class Sent:
    speaks: list[int] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)
    about: Counter[int] = field(default_factory=Counter)
    """Messages other than its speak sent about each request id."""
    unknown: Counter[int] = field(default_factory=Counter)
    """Messages about request ids never spoken."""
    junk: int = 0


def _target(sent: Sent, target: int) -> tuple[int, bool]:
    if target < 0 or not sent.speaks:
        return UNKNOWN_RID + max(target, 0), False
    return sent.speaks[target % len(sent.speaks)], True


async def _send_all(sock: zmq.asyncio.Socket, ops: list[Op]) -> Sent:
    sent = Sent()
    for op in ops:
        if isinstance(op, Pause):
            await asyncio.sleep(op.seconds)
            continue
        if isinstance(op, Junk):
            sent.junk += 1
            await sock.send_multipart(JUNK[op.kind])
            continue
        if isinstance(op, Speak):
            rid = len(sent.speaks) + 1
            sent.speaks.append(rid)
            fields: dict[str, object] = {"input": "Hello. ", "text_open": op.text_open}
            if not op.text_open:
                fields["max_tokens"] = 7 * op.frames
            if op.variant == "bad_voice":
                fields["voice"] = "nobody"
            elif op.variant == "bad_speed":
                fields["speed"] = 99.0
            await sock.send(_pack(type="speak", request_id=rid, **fields))
            continue
        rid, known = _target(sent, op.target)
        (sent.about if known else sent.unknown)[rid] += 1
        if isinstance(op, Append):
            await sock.send(_pack(type="append", request_id=rid, text=op.text, final=op.final))
        elif isinstance(op, CancelOp):
            sent.cancelled.add(rid)
            await sock.send(_pack(type="cancel", request_id=rid))
        else:
            await sock.send(_pack(type="append", request_id=rid, text=["not", "text"]))
    return sent


def _ended(replies: list[ServerMessage]) -> bool:
    return any(isinstance(m, Done | Error) for m in replies)


def _settled(sent: Sent, by_rid: dict[int | None, list[ServerMessage]]) -> bool:
    """Every answer that must come has come (those that may come are waited for by QUIET_S)."""
    for rid in sent.speaks:
        replies = by_rid.get(rid, [])
        may_stay_silent = rid in sent.cancelled and not any(isinstance(m, Started) for m in replies)
        if not _ended(replies) and not may_stay_silent:
            return False
    if len(by_rid.get(None, [])) < sent.junk:
        return False
    return all(len(by_rid.get(rid, [])) >= n for rid, n in sent.unknown.items())


def _check(ops: list[Op], sent: Sent, by_rid: dict[int | None, list[ServerMessage]]) -> None:
    where = f"sequence {ops!r}, replies {by_rid!r}"
    nulls = by_rid.get(None, [])
    assert len(nulls) == sent.junk and all(isinstance(m, Error) for m in nulls), where
    for rid, n in sent.unknown.items():
        replies = by_rid.get(rid, [])
        assert len(replies) == n, where
        assert all(isinstance(m, Error) and m.code in REFUSALS for m in replies), where
    for rid in sent.speaks:
        replies = by_rid.get(rid, [])
        ends = [i for i, m in enumerate(replies) if isinstance(m, Done | Error)]
        if not ends:  # only a request the client cancelled while it was queued
            assert rid in sent.cancelled and not replies, (rid, where)
            continue
        end = ends[0]
        before, after = replies[:end], replies[end + 1 :]
        if before:
            assert isinstance(before[0], Started), (rid, where)
            assert [m.seq for m in before[1:] if isinstance(m, Audio)] == list(
                range(len(before) - 1)
            ), (rid, where)
        # After its one end, only the answers to later messages about it (each at most one).
        assert all(isinstance(m, Error) and m.code in REFUSALS for m in after), (rid, where)
        assert len(after) <= sent.about[rid], (rid, where)
        if isinstance(replies[end], Done) and replies[end].reason == "cancelled":
            assert rid in sent.cancelled, (rid, where)


async def _run_example(h: Harness, ops: list[Op]) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(h.config.gateway.zmq_endpoint or "")
    by_rid: dict[int | None, list[ServerMessage]] = {}
    try:
        sender = asyncio.create_task(_send_all(sock, ops))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXAMPLE_TIMEOUT_S
        quiet_since: float | None = None
        while True:
            if sender.done():
                if not _settled(sender.result(), by_rid):
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = loop.time()
                elif loop.time() - quiet_since > QUIET_S:
                    break
            assert loop.time() < deadline, f"no end in {EXAMPLE_TIMEOUT_S} s: {ops!r} {by_rid!r}"
            if await sock.poll(20, zmq.POLLIN):
                msg = server_decoder.decode(await sock.recv())
                by_rid.setdefault(msg.request_id, []).append(msg)
                quiet_since = None
        _check(ops, sender.result(), by_rid)
    finally:
        sock.close(linger=0)
    # Every slot and queue place is given back.
    await wait_until(lambda: h.gateway.active_streams == 0, what="streams closed")
    await wait_until(lambda: h.gateway.admission.queued == 0, what="queue empty")
    assert h.gateway.admission.active == 0


async def test_every_request_ends_with_exactly_one_answer(
    layout: InstanceLayout, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(zmq_server, "MAX_PENDING_APPENDS", PENDING_LIMIT)
    async with running_gateway(
        layout,
        zmq=True,
        backend={"realtime": True},
        max_active_streams=2,
        max_queued_streams=3,
        queue_timeout_s=1.0,
        zmq_text_idle_timeout_s=0.5,
    ) as h:
        loop = asyncio.get_running_loop()

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded in time
        )
        @given(ops=ops_strategy)
        def one_answer_each(ops: list[Op]) -> None:
            asyncio.run_coroutine_threadsafe(_run_example(h, ops), loop).result(
                EXAMPLE_TIMEOUT_S + 10
            )

        await asyncio.to_thread(one_answer_each)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
