"""Offer one load level to a server: closed loop at fixed concurrency or open-loop arrivals.

Both loops share the phases of ``bench.load.window``: warm-up requests are not measured;
requests issued before the duration (or the request budget) runs out are measured;
then *filler* requests keep the same load until every measured request has finished,
and are cancelled (the client disconnects) once they have. A hard deadline,
``duration + drain_timeout``, bounds the level: measured requests still running then
are recorded as timeouts, never dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from bench.load.clients import SpeechClient, SpeechRequest
from bench.load.schedule import poisson_schedule
from bench.load.summary import LevelRun
from bench.load.texts import Corpus, UtteranceSource
from bench.load.trace import Outcome, StreamTrace
from bench.load.window import TrimPolicy
from common.aio import wait_event

ProgressHook = Callable[[StreamTrace], None]


class LevelPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How long and how much one level runs, and what it asks for."""

    duration_s: float = 60.0
    """Measured requests are issued during this long (after warm-up)."""
    max_requests: int | None = None
    """At most this many measured requests per level."""
    warmup_s: float | None = None
    """Requests scheduled earlier are warm-up, and throughput is counted from then on.
    None: 10% of the duration. A closed loop's whole first wave is warm-up as well."""
    drain_timeout_s: float = 120.0
    """After the duration, how long measured requests may take to finish."""
    long_fraction: float = 0.2
    seed: int = 0
    voice: str = "tara"
    model: str = "tts-1"
    fixed_tokens: int | None = None
    retry_backoff_s: float = 0.5
    """A closed-loop client waits this long after a failed request before the next one."""
    honour_retry_after: bool = False
    """A refused closed-loop client waits the refusal's ``Retry-After`` instead (where it
    has one), as a well-behaved client does."""

    def trim(self, mode: Literal["closed", "open"], concurrency: int = 0) -> TrimPolicy:
        warmup = 0.1 * self.duration_s if self.warmup_s is None else self.warmup_s
        return TrimPolicy(
            skip_first=concurrency if mode == "closed" else 0,
            warmup_s=warmup,
            duration_s=self.duration_s,
            max_requests=self.max_requests,
        )


class _Level:
    """Book-keeping shared by both loops: issue order, phases, completion of measured work."""

    def __init__(
        self,
        client: SpeechClient,
        plan: LevelPlan,
        trim: TrimPolicy,
        corpus: Corpus,
        on_issue: ProgressHook | None,
        on_done: ProgressHook | None,
    ) -> None:
        self.client = client
        self.plan = plan
        self.trim = trim
        self.source = UtteranceSource(corpus, plan.long_fraction, plan.seed)
        self.on_issue = on_issue
        self.on_done = on_done
        self.traces: list[StreamTrace] = []
        self.started = _now()
        self.measured_issued = 0
        self.measured_pending = 0
        self.phase_over = asyncio.Event()
        """No more measured requests will be issued."""
        self.finished = asyncio.Event()
        """The phase is over and every measured request has finished."""
        self.measure_end: float | None = None

    def close_phase(self) -> None:
        self.phase_over.set()
        if self.measured_pending == 0:
            self.finished.set()

    def issue(self, scheduled: float) -> tuple[StreamTrace, SpeechRequest]:
        """The next request, scheduled at ``scheduled``: measured, warm-up or filler."""
        offset = scheduled - self.started
        if offset >= self.trim.duration_s:
            self.close_phase()
        index = len(self.traces)
        measured = not self.phase_over.is_set() and self.trim.is_measured(
            index, offset, self.measured_issued
        )
        utterance = self.source.next()
        trace = StreamTrace(
            index=index,
            kind=utterance.kind,
            chars=len(utterance.text),
            scheduled=scheduled,
            measured=measured,
        )
        self.traces.append(trace)
        if measured:
            self.measured_issued += 1
            self.measured_pending += 1
            if self.measured_issued == self.trim.max_requests:
                self.close_phase()
        if self.on_issue is not None:
            self.on_issue(trace)
        request = SpeechRequest(
            text=utterance.text,
            voice=self.plan.voice,
            model=self.plan.model,
            max_tokens=self.plan.fixed_tokens,
        )
        return trace, request

    async def run_one(self, trace: StreamTrace, request: SpeechRequest) -> None:
        try:
            await self.client.stream(request, trace)
        except asyncio.CancelledError:
            if trace.outcome is None:
                trace.outcome = Outcome.TIMEOUT if trace.measured else Outcome.CANCELLED
            if trace.done is None:
                trace.done = _now()
            raise
        finally:
            if trace.measured:
                self.measured_pending -= 1
                if self.phase_over.is_set() and self.measured_pending == 0:
                    self.finished.set()
            if self.on_done is not None:
                self.on_done(trace)

    async def wait_finished(self) -> bool:
        """End the measured phase at the duration (or earlier, when the request budget is
        spent), then wait for the measured requests until the hard deadline.
        Returns True when the deadline was hit."""
        if not await wait_event(self.phase_over, self.started + self.plan.duration_s - _now()):
            self.close_phase()
        deadline = self.started + self.plan.duration_s + self.plan.drain_timeout_s
        try:
            return not await wait_event(self.finished, max(0.0, deadline - _now()))
        finally:
            self.measure_end = _now()

    def record(
        self,
        mode: Literal["closed", "open"],
        deadline_hit: bool,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
    ) -> LevelRun:
        return LevelRun(
            mode=mode,
            concurrency=concurrency,
            rate=rate,
            started=self.started,
            measure_start=self.started + self.trim.warmup_s,
            measure_end=self.measure_end if self.measure_end is not None else _now(),
            finished=_now(),
            deadline_hit=deadline_hit,
            traces=self.traces,
        )


def _now() -> float:
    return time.perf_counter()


async def _sleep_until(t: float) -> None:
    delay = t - _now()
    if delay > 0:
        await asyncio.sleep(delay)


async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_closed(
    client: SpeechClient,
    concurrency: int,
    plan: LevelPlan,
    corpus: Corpus,
    *,
    on_issue: ProgressHook | None = None,
    on_done: ProgressHook | None = None,
) -> LevelRun:
    """``concurrency`` clients, each starting its next utterance as soon as the last ends."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    level = _Level(client, plan, plan.trim("closed", concurrency), corpus, on_issue, on_done)

    async def user() -> None:
        while not level.finished.is_set():
            trace, request = level.issue(_now())
            await level.run_one(trace, request)
            if trace.outcome is not Outcome.OK:
                wait = trace.retry_after_s if plan.honour_retry_after else None
                await asyncio.sleep(plan.retry_backoff_s if wait is None else wait)

    tasks = {asyncio.create_task(user()) for _ in range(concurrency)}
    deadline_hit = await level.wait_finished()
    await _cancel_all(tasks)
    return level.record("closed", deadline_hit, concurrency=concurrency)


async def run_open(
    client: SpeechClient,
    rate_per_s: float,
    plan: LevelPlan,
    corpus: Corpus,
    *,
    on_issue: ProgressHook | None = None,
    on_done: ProgressHook | None = None,
) -> LevelRun:
    """Poisson arrivals at ``rate_per_s`` from a schedule computed before the first send.

    The dispatcher only sleeps until each slot and starts the request as its own task: it
    never waits on a request, so a stalled server cannot delay later arrivals.
    """
    level = _Level(client, plan, plan.trim("open"), corpus, on_issue, on_done)
    horizon = plan.duration_s + plan.drain_timeout_s
    offsets = poisson_schedule(rate_per_s, horizon, seed=plan.seed)
    tasks: set[asyncio.Task[None]] = set()

    async def dispatch() -> None:
        for offset in offsets:
            await _sleep_until(level.started + offset)
            if level.finished.is_set():
                return
            trace, request = level.issue(level.started + offset)
            task = asyncio.create_task(level.run_one(trace, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    dispatcher = asyncio.create_task(dispatch())
    deadline_hit = await level.wait_finished()
    dispatcher.cancel()
    await asyncio.gather(dispatcher, return_exceptions=True)
    await _cancel_all(set(tasks))
    return level.record("open", deadline_hit, rate=rate_per_s)
