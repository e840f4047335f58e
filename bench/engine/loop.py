"""The closed loop: a level's fixed-length requests kept in one engine, a finished one
replaced at once, the first wave's starts staggered."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from bench.engine.levels import first_wave_lengths


@dataclass
class Loop:
    """N streams, each one request at a time, replaced as it finishes; every step signal is
    timestamped and wakes the pump, which reads every collector (like the worker's)."""

    engine: Any
    make_params: Any
    prompts: list[list[int]]
    streams: int
    tokens: int
    stamps: list[float] = field(default_factory=list)
    delivered: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    _collectors: list[Any] = field(default_factory=list)
    """Each stream's current request's output collector (None before its first)."""
    _rids: list[str] = field(default_factory=list)
    _next: int = 0

    def on_step(self) -> None:
        self.stamps.append(time.perf_counter())
        self.wake.set()

    async def _start(self, i: int, tokens: int) -> None:
        self._next += 1
        rid = f"s{self.streams}-{i}-{self._next}"
        prompt = self.prompts[self._next % len(self.prompts)]
        collector = await self.engine.add(rid, prompt, self.make_params(len(prompt), tokens))
        self._collectors[i] = collector
        self._rids[i] = rid

    async def fill(self) -> None:
        self._collectors = [None] * self.streams
        self._rids = [""] * self.streams
        for i, n in enumerate(first_wave_lengths(self.streams, self.tokens)):
            await self._start(i, n)

    async def pump(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            for i, c in enumerate(self._collectors):
                out = c.get_nowait() if c is not None else None
                if out is None:
                    continue
                self.delivered += len(out.outputs[0].token_ids)
                if out.finished:
                    await self._start(i, self.tokens)

    async def wait_steps(self, n: int, pump: asyncio.Task[None]) -> None:
        """Until ``n`` more steps were signalled (raises what ended the pump, if it ended)."""
        await self.wait_until(len(self.stamps) + n, pump)

    async def wait_until(self, count: int, pump: asyncio.Task[None]) -> None:
        while len(self.stamps) < count:
            if pump.done():
                pump.result()
                raise RuntimeError("the closed loop's pump stopped")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.engine.llm.abort([r for r in self._rids if r])
        await asyncio.sleep(0.5)
