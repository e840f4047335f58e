"""The control channel between the parent and each engine process (a socket pair, one JSON
line a message), an engine's side of it, and the name of the shared-memory board both
sides know an engine process by."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import time
from typing import Any

import msgspec

#
# One JSON object a line over a socketpair. The parent: {"level": n}, {"go": true},
# {"stop": true}, {"quit": true}. An engine: {"ready": {...}}, {"warm": true},
# {"reached": true}, {"result": EngineLevel}, {"error": "one line"}.


def board_name(pid: int) -> str:
    """The prevented-token board (shared memory) of the engine in process ``pid``: the
    child creates it, the parent removes it when the child was killed."""
    return f"orpheus-bench-{pid}-prevented"


class Channel:
    """The parent's end: blocking, with a deadline, watching the engine's process."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self.sock = sock
        self.proc = proc
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(msgspec.json.encode(msg) + b"\n")

    def recv(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the engine process in time")
            ready, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine process exited ({self.proc.returncode})")
                continue
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"the engine process closed its channel ({self.proc.poll()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg = msgspec.json.decode(line)
        if "error" in msg:
            raise RuntimeError(str(msg["error"]))
        return msg

    def expect(self, key: str, deadline: float) -> Any:
        msg = self.recv(deadline)
        if key not in msg:
            raise RuntimeError(f"the engine process said {msg!r}, expected {key!r}")
        return msg[key]


class EngineSide:
    """The engine process's end (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, fd: int) -> EngineSide:
        sock = socket.socket(fileno=fd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, msg: dict[str, Any]) -> None:
        self.writer.write(msgspec.json.encode(msg) + b"\n")
        await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        line = await self.reader.readline()
        if not line:
            raise RuntimeError("the benchmark's parent closed the channel")
        return msgspec.json.decode(line)
