"""One client connection's writes: every byte the gateway sends a client goes through the
``ClientLink`` of its connection.

A connection outlives its units: a WebSocket speaks many units (each a request of
``gateway.requests``, admitted, streamed and finished on its own), an ElevenLabs HTTP
response speaks one per sentence, and some audio is written after the unit that made it
has ended (an encoder's tail, vLLM-Omni's non-streamed units, an ElevenLabs dialogue's
pauses). So the contract is split by lifetime, as vLLM's realtime ``RealtimeConnection``
(one object per socket owns every send) splits it:

- the link (one per connection, ``ClientLinks.open``) owns every write: the stall
  watchdog's clock (``write`` marks a write as started until it returns), the audio bytes
  (the ``api``'s counter), the abort (``on_abort`` tears the connection down: a client that
  stopped reading, the gateway stopping);
- the request (one per unit) owns admission, its stream, its outcome and its time to first
  audio: a write names the units whose audio it carries (``unit`` or ``units``), and each
  of them is told (``Unit.audio_written``), whether it is still streaming or ended a while
  ago.

A front end never touches the metrics (.importlinter's ``frontends-no-metrics``)::

    with gateway.links.open(Api.OPENAI_HTTP, abort_of(request)) as link:
        async with gateway.requests.open(params, link) as unit:
            while chunks := await unit.stream.next_chunks():
                await link.write(resp.write(data), len(data), unit)
            await link.write(resp.write(tail), len(tail), unit)  # also after the unit
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

BYTES_METRIC_BATCH = 64 * 1024
"""Audio bytes a link accumulates before it adds them to the counter (a locked update per
chunk costs; the rest is added when the link closes)."""


class Unit(Protocol):
    """What a link needs of a unit (``gateway.requests.ActiveRequest``)."""

    def audio_written(self, n: int) -> None:
        """``n`` bytes of this unit's audio reached the client (the first time: its time to
        first audio; 0 for a unit whose audio another unit's write carries on)."""

    def drop(self, why: str) -> None:
        """The client stopped reading this unit's audio: fail its stream, abort the link."""


CONTINUE_S = 1.0
"""A unit that starts this soon after its connection's previous one ended continues an
admitted stream (the next sentence of one response, of one utterance): it is not queued or
refused by the learned limit (``gateway.admission``), so an admitted stream is never cut."""


class ClientLink:
    """The writes of one client connection (see the module docstring)."""

    __slots__ = (
        "_in_flight",
        "_links",
        "_loop",
        "_unreported",
        "_writing",
        "api",
        "bytes_sent",
        "key",
        "on_abort",
        "unit_ended_at",
        "units_open",
        "write_started",
    )

    def __init__(
        self,
        links: ClientLinks,
        api: str,
        on_abort: Callable[[], None] | None,
        key: str = "",
    ) -> None:
        self._links = links
        self._loop = links.loop
        self.api = api
        self.key = key
        """The API key the client presented ("" without one): admission counts per key."""
        self.units_open = 0
        """Units of this connection admitted and not finished (``gateway.requests``)."""
        self.unit_ended_at = -math.inf
        """Loop time its last unit finished."""
        self.on_abort = on_abort
        """Tears the client's connection down (None: nothing to tear down, e.g. a job)."""
        self.bytes_sent = 0
        """Audio bytes written to the client over the connection's life."""
        self._unreported = 0
        self.write_started = 0.0
        """Loop time at which a write to the client began and has not finished (0: none)."""
        self._writing: Unit | None = None
        """The unit whose audio the latest write in flight carries (the one a drop fails)."""
        self._in_flight = 0

    async def write(
        self,
        pending: Awaitable[object],
        n: int = 0,
        unit: Unit | None = None,
        units: Sequence[Unit] = (),
    ) -> None:
        """Await ``pending``, a write to the client carrying ``n`` audio bytes (0: a control
        message, headers, an end) of ``unit`` (or of ``units``: audio held across units,
        written after some of them ended). The stall watchdog times it; once it returns
        the bytes are counted and each unit is told (its time to first audio)."""
        if unit is not None:
            self._writing = unit
        elif units:
            self._writing = units[-1]
        loop = self._loop
        if not self._in_flight:
            self.write_started = loop.time()
        self._in_flight += 1
        try:
            await pending
        finally:
            # Writes of several units may overlap (ElevenLabs' contexts on one socket): the
            # clock is the time since the client last took data while a write waits.
            self._in_flight -= 1
            if self._in_flight:
                self.write_started = loop.time()
            else:
                self.write_started = 0.0
                self._writing = None
        if n > 0:  # ``wrote``, inlined: this is the per-chunk path
            self.bytes_sent += n
            self._unreported += n
            if self._unreported >= BYTES_METRIC_BATCH:
                self._report()
            if unit is not None:
                unit.audio_written(n)
            if units:
                self._credit(n, units)

    def wrote(self, n: int, unit: Unit | None = None, units: Sequence[Unit] = ()) -> None:
        """Account ``n`` audio bytes delivered without a wait to time (a job's unit goes to
        its buffer, not to a socket), as ``write`` does for what it wrote."""
        if n <= 0:
            return
        self.bytes_sent += n
        self._unreported += n
        if self._unreported >= BYTES_METRIC_BATCH:
            self._report()
        if unit is not None:
            unit.audio_written(n)
        if units:
            self._credit(n, units)

    @staticmethod
    def _credit(n: int, units: Sequence[Unit]) -> None:
        """Audio held across ``units``: each has its first audio, the latest the bytes."""
        last = units[-1]
        for u in units:
            u.audio_written(n if u is last else 0)

    def abort(self) -> None:
        """Tear the connection down (a slow client, the gateway stopping)."""
        if self.on_abort is not None:
            self.on_abort()

    def drop(self, why: str) -> None:
        """The client accepted no data for too long: fail the unit being written (its stream
        is cancelled upstream) and tear the connection down."""
        self.write_started = 0.0
        unit, self._writing = self._writing, None
        if unit is not None:
            unit.drop(why)  # counts the drop and aborts this link (``StreamRegistry``)
            return
        self._links.metrics.slow_client_drops.inc()
        log.info("%s client: dropping it (%s)", self.api, why)
        self.abort()

    def _report(self) -> None:
        if self._unreported:
            self._links.metrics.bytes_sent_by_api[self.api].inc(self._unreported)
            self._unreported = 0

    def continues(self, now: float) -> bool:
        """A new unit now continues a stream this connection was admitted for."""
        return self.units_open > 0 or now - self.unit_ended_at <= CONTINUE_S

    def close(self) -> None:
        """The connection is done: count what is left and leave the watchdog's view."""
        self._report()
        self._links.active.discard(self)


class ClientLinks:
    """The open links of one gateway process: the stall watchdog's and the drain's view."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.active: set[ClientLink] = set()
        self.loop: asyncio.AbstractEventLoop  # set by ``start``

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __len__(self) -> int:
        return len(self.active)

    @contextmanager
    def open(
        self, api: str, on_abort: Callable[[], None] | None = None, *, key: str = ""
    ) -> Iterator[ClientLink]:
        """The link of a connection, for the ``with`` block that serves it; ``key``: the
        API key its client presented."""
        link = ClientLink(self, api, on_abort, key)
        self.active.add(link)
        try:
            yield link
        finally:
            link.close()

    def sweep(self, now: float, stall_s: float) -> None:
        """The watchdog's pass: drop clients that accepted no data for ``stall_s``."""
        for link in [k for k in self.active if k.write_started]:
            if now - link.write_started > stall_s:
                link.drop(f"the client accepted no data for {stall_s:g} s")

    def abort_writers(self) -> None:
        """Tear down the connections that are writing (the gateway stops)."""
        for link in [k for k in self.active if k.write_started]:
            link.abort()
