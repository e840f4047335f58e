"""Load clients of ``bench gateway``: many streaming HTTP requests from one process.

A lean HTTP/1.1 client on asyncio protocols (no client library per chunk), so the client
processes cost little next to the gateway they measure. Each slot keeps one keep-alive
connection and runs requests back to back (closed loop) until the level ends. The PCM of
every chunk starts with the synthetic backend's ``time.monotonic_ns()`` stamp from the
moment it was written into the ring: the client records, per chunk, the time from that
stamp to the chunk's last byte arriving here (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from array import array
from multiprocessing.connection import Connection
from typing import cast

import msgspec

CHUNK_BYTES = 2048 * 2
_STAMP = struct.Struct("<q")


class LevelSpec(msgspec.Struct, frozen=True):
    port: int
    streams: int
    body: bytes
    start_ns: int
    """Slots start spread over ``ramp_s`` from here."""
    ramp_s: float
    measure_from_ns: int
    end_ns: int


class LevelResult(msgspec.Struct):
    lags_us: list[int]
    """Delivery lag of every chunk completed inside the measurement window."""
    ttfb_ms: list[float]
    chunks: int
    audio_bytes: int
    requests: int
    errors: int
    error_samples: list[str]


class _Totals:
    def __init__(self, spec: LevelSpec) -> None:
        self.spec = spec
        self.lags = array("q")
        self.ttfb_ms: list[float] = []
        self.chunks = 0
        self.audio_bytes = 0
        self.requests = 0
        self.errors = 0
        self.error_samples: list[str] = []

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:200])


class _Stream(asyncio.Protocol):
    """One keep-alive connection running one request at a time; parses chunked PCM."""

    def __init__(self, totals: _Totals, request: bytes) -> None:
        self.t = totals
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = "head"
        self.need = 0
        self.offset = 0  # bytes of audio received in this response
        self.stamp = bytearray()
        self.sent_ns = 0
        self.done: asyncio.Future[bool] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(False)
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self) -> asyncio.Future[bool]:
        assert self.transport is not None
        self.state, self.need, self.offset = "head", 0, 0
        self.buf.clear()
        self.stamp.clear()
        self.done = asyncio.get_running_loop().create_future()
        self.sent_ns = time.monotonic_ns()
        self.transport.write(self.request)
        return self.done

    def _finish(self, ok: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)

    def _audio(self, data: memoryview, now_ns: int) -> None:
        t = self.t
        if self.offset == 0 and t.spec.measure_from_ns <= now_ns:
            t.ttfb_ms.append((now_ns - self.sent_ns) / 1e6)
        pos = 0
        n = len(data)
        while pos < n:
            in_chunk = self.offset % CHUNK_BYTES
            if in_chunk < 8:
                take = min(8 - in_chunk, n - pos)
                self.stamp += data[pos : pos + take]
            take = min(CHUNK_BYTES - in_chunk, n - pos)
            pos += take
            self.offset += take
            if self.offset % CHUNK_BYTES == 0:  # a whole chunk is here
                if t.spec.measure_from_ns <= now_ns <= t.spec.end_ns:
                    (stamp,) = _STAMP.unpack(self.stamp)
                    t.lags.append((now_ns - stamp) // 1000)
                    t.chunks += 1
                    t.audio_bytes += CHUNK_BYTES
                self.stamp.clear()

    def data_received(self, data: bytes) -> None:
        now_ns = time.monotonic_ns()
        buf = self.buf
        buf += data
        pos = 0
        while True:
            if self.state == "head":
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                status_line = bytes(buf[pos : buf.find(b"\r\n", pos)])
                pos = end + 4
                if not status_line.startswith(b"HTTP/1.1 200"):
                    self.t.error(status_line.decode(errors="replace"))
                    self._finish(False)
                    if self.transport is not None:
                        self.transport.close()
                    return
                self.state = "size"
            elif self.state == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                self.need = int(bytes(buf[pos:end]).split(b";")[0], 16)
                pos = end + 2
                self.state = "data" if self.need else "trailer"
            elif self.state == "data":
                take = min(self.need, len(buf) - pos)
                if take == 0:
                    break
                self._audio(memoryview(buf)[pos : pos + take], now_ns)
                pos += take
                self.need -= take
                if self.need == 0:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(buf) - pos < 2:
                    break
                pos += 2
                self.state = "size"
            else:  # trailer: the empty line after the last chunk
                if len(buf) - pos < 2:
                    break
                pos += 2
                self.state = "idle"
                self.t.requests += 1
                self._finish(True)
                break
        del buf[:pos]


async def _slot(totals: _Totals, index: int, request: bytes) -> None:
    spec = totals.spec
    loop = asyncio.get_running_loop()
    start = spec.start_ns + int(index * spec.ramp_s * 1e9 / max(1, spec.streams))
    await asyncio.sleep(max(0.0, (start - time.monotonic_ns()) / 1e9))
    conn: _Stream | None = None
    while time.monotonic_ns() < spec.end_ns:
        if conn is None or conn.transport is None or conn.transport.is_closing():
            try:
                _, conn = await loop.create_connection(
                    lambda: _Stream(totals, request), "127.0.0.1", spec.port
                )
            except OSError as e:
                totals.error(f"connect: {e}")
                await asyncio.sleep(0.1)
                continue
        ok = await conn.send()
        if not ok:
            conn = None
            await asyncio.sleep(0.05)
    if conn is not None and conn.transport is not None:
        conn.transport.abort()


async def run_level(spec: LevelSpec) -> LevelResult:
    totals = _Totals(spec)
    body = spec.body
    request = (
        b"POST /v1/audio/speech HTTP/1.1\r\n"
        + f"Host: 127.0.0.1:{spec.port}\r\nContent-Type: application/json\r\n".encode()
        # Every stream says the same text: without no-store the sentence audio cache
        # would answer them (single flight, then hits) and the bench would measure it.
        + b"Cache-Control: no-store\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    slots = [asyncio.create_task(_slot(totals, i, request)) for i in range(spec.streams)]
    await asyncio.sleep(max(0.0, (spec.end_ns - time.monotonic_ns()) / 1e9))
    # Requests in flight at the end are abandoned: the gateway cancels them upstream.
    _, pending = await asyncio.wait(slots, timeout=0.5)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return LevelResult(
        lags_us=totals.lags.tolist(),
        ttfb_ms=totals.ttfb_ms,
        chunks=totals.chunks,
        audio_bytes=totals.audio_bytes,
        requests=totals.requests,
        errors=totals.errors,
        error_samples=totals.error_samples,
    )


def client_main(conn: Connection) -> None:
    """Client process: say ready, receive a ``LevelSpec``, run it, send back the result."""
    import resource

    import uvloop

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    conn.send_bytes(b"ready")
    spec = msgspec.msgpack.decode(conn.recv_bytes(), type=LevelSpec)
    result = uvloop.run(run_level(spec))
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()
