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

from gateway.streams import PcmStream, silence_pcm
from gateway.text.breaks import Pause, Piece
from shm.records import StreamEnd

_SEVERITY = {"stop": 0, "length": 1, "repetition": 2}


class Runs:
    """The runs of text and pauses of a request not yet spoken, and the sum of the ENDs of
    those that were (the request's END: its frames and tokens)."""

    __slots__ = ("_pieces", "frames", "prevented", "reason", "tokens")

    def __init__(self, pieces: list[Piece]) -> None:
        self._pieces: deque[Piece] = deque(pieces)
        self.frames = 0
        self.tokens = 0
        self.prevented = 0
        self.reason = "stop"

    def next_text(self, stream: PcmStream) -> str | None:
        """Push the silence of the pauses before the next run into ``stream``; that run's
        text (None: none is left, the pauses pushed were the last)."""
        pause = 0
        pieces = self._pieces
        while pieces:
            p = pieces[0]
            if isinstance(p, Pause):
                pause += p.ms
            elif p.strip():
                break
            pieces.popleft()  # a pause, or blank text between two tags
        if pause:
            stream.push(silence_pcm(pause))
        return str(pieces.popleft()).strip() if pieces else None

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
