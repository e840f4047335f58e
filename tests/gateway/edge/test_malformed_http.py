"""Malformed HTTP requests: answered 400, logged once per client per interval, without their
bytes, at WARNING or below (``gateway.edge.malformed_http``)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from gateway_harness import running_gateway

from gateway.edge.malformed_http import MalformedRequestLog, safe_reason
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

BIG = b"A" * 200_000
MALFORMED = {
    "content_length_and_chunked": b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "negative_content_length": b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: -5\r\n\r\n",
    "200_kb_header_line": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + BIG + b"\r\n\r\n",
    "5000_headers": b"GET /health HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: v%d\r\n" % (i, i) for i in range(5000))
    + b"\r\n",
}


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:  # the server answered and closed while we still sent
        return b""
    finally:
        writer.close()


async def test_malformed_requests_get_400_and_one_clean_log_line(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with running_gateway(layout) as h:
        answers = []
        for _ in range(50):
            for request in MALFORMED.values():
                answers.append(await _exchange(h.port, request))
        healthy = await _exchange(
            h.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
    assert all(a.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")) for a in answers if a)
    assert sum(1 for a in answers if a) >= 150  # a reset may race the answer now and then
    assert healthy.startswith(b"HTTP/1.1 200")
    server = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert all(r.levelno <= logging.WARNING and r.exc_info is None for r in server)
    lines = [r.getMessage() for r in server]
    malformed = [line for line in lines if "malformed HTTP request" in line]
    assert len(malformed) == 1 and "127.0.0.1" in malformed[0], lines
    text = "\n".join(lines)
    assert "AAAA" not in text and "X-H4999" not in text and "-5" not in text


def test_the_limit_is_per_client_and_counts_what_it_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = MalformedRequestLog(logging.getLogger("test.malformed"), 10.0, clock=lambda: now[0])
    bad = LineTooLong(b"A" * 300, 8190)
    with caplog.at_level(logging.DEBUG, "test.malformed"):
        for t in (0.0, 1.0, 2.0, 9.0, 10.5, 11.0):
            now[0] = t
            log.exception("Error handling request from %s", "10.0.0.1", exc_info=bad)
            log.exception("Error handling request from %s", "10.0.0.2", exc_info=bad)
        log.exception("unhandled error in %s", "GET /x", exc_info=ValueError("boom"))
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(messages) == 5
    assert [m for _, m in messages[:4]] == [
        messages[0][1],
        messages[0][1].replace("10.0.0.1", "10.0.0.2"),
        messages[2][1],
        messages[2][1].replace("10.0.0.1", "10.0.0.2"),
    ]
    assert "(3 more from this client not logged)" in messages[2][1]
    assert all(level == logging.WARNING for level, _ in messages[:4])
    assert "AAA" not in "".join(m for _, m in messages)
    assert messages[4] == (logging.ERROR, "unhandled error in GET /x")  # not a parse error
    assert caplog.records[4].exc_info is not None


def test_reasons_keep_the_words_and_drop_the_bytes() -> None:
    assert safe_reason(LineTooLong(b"A" * 300, 8190)) == (
        "LineTooLong: Got more than 8190 bytes when reading"
    )
    assert safe_reason(
        BadHttpMessage("Transfer-Encoding can't be present with Content-Length")
    ) == ("BadHttpMessage: Transfer-Encoding can't be present with Content-Length")
    assert safe_reason(BadHttpMessage("Invalid character in Content-Length:\n\n  b'-5'\n ^")) == (
        "BadHttpMessage: Invalid character in Content-Length"
    )
