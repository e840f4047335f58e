"""The pauses of one request: its text cut at break tags into runs, spoken in turn.

A request whose text has ``<break>`` tags (``gateway.text.breaks``: OpenAI's ``input``,
Baseten's ``predict``, a ZeroMQ ``Speak``, a job's unit) stays one request: one admission
slot, one ``PcmStream`` its front end reads, one client response. What the workers see is
one complete stream per run of text, started when the one before ended; between two runs
the gateway pushes the pause's silence into the request's ``PcmStream``, so the client gets
speech, silence, speech in order, with no model token spent on the pause. Each run is an
utterance of its own to the llm and codec workers: its frames and chunks are numbered from
0 under its own stream id, and its last frame is decoded against its own right edge, as
before any real silence.

``Runs`` holds what is left; ``gateway.requests.RequestTracker`` starts each run
(``StreamRegistry.reopen`` routes the new id to the same ``PcmStream``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from gateway.text.breaks import Piece
from shm.records import StreamEnd

_SEVERITY = {"stop": 0, "length": 1, "repetition": 2}

Silence = Callable[[int], None]
"""Pushes that many ms of silence into the request's stream
(``gateway.streams.StreamRegistry.push_silence``)."""


class Runs:
    """The runs of text and pauses of a request not yet spoken, and the sum of the ENDs of
    those that were (the request's END: its frames and tokens).

    Open text (ZeroMQ's ``text_open``): the run being spoken takes the text appended to it
    until a break tag comes (``run_open``); what follows the tag waits here for that run to
    end, then starts the next run, open again unless the client's text is complete (``open``
    false). A later run with no words yet is not started in the workers (``in_workers``
    false) until words come: a run closed with no text would be refused there."""

    __slots__ = (
        "_pieces", "frames", "in_workers", "open", "prevented", "reason", "run_open",
        "run_spoken", "tokens", "traceparent",
    )  # fmt: skip

    def __init__(
        self, pieces: list[Piece], *, open_text: bool = False, traceparent: str = ""
    ) -> None:
        self._pieces: deque[Piece] = deque(pieces)
        self.traceparent = traceparent
        """The request's trace context, sent with each run (tracing on)."""
        self.in_workers = True
        """A run of the request is in the workers (its END will come)."""
        self.open = open_text
        """More text may come from the client (appends)."""
        self.run_open = False
        """The run in the workers takes appended text (its text was sent ``text_open``)."""
        self.run_spoken = False
        """The run in the workers was sent words (before that, a pause's silence may go
        straight into the stream: no audio of the run can come before it)."""
        self.frames = 0
        self.tokens = 0
        self.prevented = 0
        self.reason = "stop"

    def next_run(self, silence: Silence) -> tuple[str, bool] | None:
        """Push the silence of the pauses before the next run (``silence``: into the
        request's stream); that run's text and whether it stays open for appended text
        (None: nothing is left to say)."""
        pieces = self._pieces
        pause = 0
        text = ""
        while pieces:
            p = pieces.popleft()
            if isinstance(p, str):
                text += p  # several appends of one run
            elif text.strip():
                pieces.appendleft(p)  # the run ends at this tag
                break
            else:
                pause += p.ms  # blank text between two tags is no run
                text = ""
        if pause:
            silence(pause)
        self.run_open = self.open and not pieces
        self.run_spoken = bool(text.strip())
        if not self.run_open and not self.run_spoken:
            return None
        return (text if self.run_open else text.strip()), self.run_open

    def append(self, pieces: list[Piece], final: bool, silence: Silence) -> list[tuple[str, bool]]:
        """Text appended by the client (``final``: its last): the appends to send to the run
        in the workers, ``(text, final)``, in order. A break tag ends that run (its text is
        closed); the pieces after it wait for the run's END (``next_run``). A tag before any
        word of the run is silence pushed at once (``silence``)."""
        if final:
            self.open = False
        if not self.run_open or not self.in_workers:
            self._pieces.extend(pieces)
            return []
        sends: list[tuple[str, bool]] = []
        text = ""
        for i, p in enumerate(pieces):
            if isinstance(p, str):
                text += p
                self.run_spoken |= bool(p.strip())
            elif not self.run_spoken:
                silence(p.ms)
            else:
                sends.append((text, True))
                self.run_open = False
                self._pieces.extend(pieces[i:])
                return sends
        if text or final:
            sends.append((text, final))
            self.run_open = not final
        return sends

    def add(self, end: StreamEnd) -> None:
        """A run ended with ``end``."""
        self.frames += end.frames
        self.tokens += end.tokens
        self.prevented += end.invalid_tokens_prevented
        if _SEVERITY.get(end.reason, 3) > _SEVERITY.get(self.reason, 3):
            self.reason = end.reason

    def end(self) -> StreamEnd:
        """The request's END: every run's frames and tokens, the worst run's reason."""
        return StreamEnd(self.reason, self.frames, self.tokens, self.prevented)
