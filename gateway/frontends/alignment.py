"""Estimated character and word timing of the audio of a text unit.

Orpheus gives no alignment. What the gateway does know is which text unit each audio frame
speaks (it cut the text into units, ``gateway.frontends.text_units``, and each unit is its own
stream) and, once a unit ends, how long its audio is. The estimate spreads a unit's
characters over its audio in proportion to a weight per character class: vowels are the
longest sounds, consonants shorter, spaces a short gap, punctuation a pause (a sentence end
longer than a comma), digits several sounds each. It is an estimate, not a measurement:
good enough to tell which words a listener heard before a barge-in, not for lip sync.

Two shapes:

- ``ChunkAligner``: per audio chunk while the audio streams (ElevenLabs messages). A chunk's
  end is known when it is sent, the unit's length only at its end, so characters are
  released as the audio advances against an expected length (``MS_PER_WEIGHT`` per unit of
  weight, stretched while the audio runs longer), the last character is held back until
  the unit ends, and the last message of the unit carries whatever is left. Times in each
  message start at 0 at the end of the previous message's span, and the spans of all
  messages add up to the audio: a client that advances its clock by each message's span
  (Pipecat does) stays on the audio's clock.
- ``word_times``: once the unit's audio length is known (vLLM-Omni's ``word_timestamps``).

A unit after a break tag starts with the pause's silence (``lead_ms``,
``gateway.frontends.text_units.Unit.pause_ms``): no character is given any of it, so the
first character starts after the gap (ElevenLabs: the first message with characters has
its first one start at the end of the silence within its span).
"""

from __future__ import annotations

import msgspec

VOWELS = frozenset("aeiouyAEIOUYàáâäèéêëìíîïòóôöùúûüÀÁÂÄÈÉÊËÌÍÎÏÒÓÔÖÙÚÛÜ")
SENTENCE_PAUSE = frozenset(".!?…。！？")
CLAUSE_PAUSE = frozenset(',;:，；：-–—()"')
MS_PER_WEIGHT = 62.0
"""Expected speaking rate: about 15 characters per second of English speech."""
_HOLD_FRACTION = 0.92
"""Before the unit ends, at most this share of its expected audio is given characters."""


def char_weight(c: str) -> float:
    if c in VOWELS:
        return 1.25
    if c.isspace():
        return 0.6
    if c in SENTENCE_PAUSE:
        return 4.0
    if c in CLAUSE_PAUSE:
        return 2.5
    if c.isdigit():
        return 3.0
    if c.isalpha():
        return 0.85
    return 0.5


class CharTimes(msgspec.Struct, frozen=True):
    """ElevenLabs' alignment object: times in ms from 0 within one message."""

    chars: list[str]
    charStartTimesMs: list[int]
    charDurationsMs: list[int]


def _layout(
    chars: list[str], weights: list[float], span_ms: float, offset_ms: float = 0.0
) -> CharTimes:
    """``chars`` spread over [offset_ms, span_ms] in proportion to ``weights`` (integer ms
    that end at ``span_ms``; nothing before ``offset_ms``)."""
    total = sum(weights) or 1.0
    starts: list[int] = []
    durs: list[int] = []
    acc = 0.0
    offset = round(offset_ms)
    span_ms -= offset
    prev = offset
    for w in weights:
        acc += w
        end = offset + round(span_ms * acc / total)
        starts.append(prev)
        durs.append(end - prev)
        prev = end
    return CharTimes(chars, starts, durs)


class ChunkAligner:
    """Character timing of one unit, handed out chunk by chunk."""

    def __init__(self, raw: str, lead_ms: float = 0.0) -> None:
        self._lead_ms = lead_ms
        """Silence before the unit's speech (a pause): no character is laid on it."""
        self._chars = list(raw)
        self._weights = [char_weight(c) for c in self._chars]
        self._cum: list[float] = []
        acc = 0.0
        for w in self._weights:
            acc += w
            self._cum.append(acc)
        self._total_weight = acc
        self._expected_ms = acc * MS_PER_WEIGHT
        self._released = 0
        self._audio_ms = 0.0
        self._span_start_ms = 0.0
        """Audio time at which the span of the next message starts."""

    @property
    def remaining(self) -> int:
        return len(self._chars) - self._released

    def take(self, chunk_ms: float, *, last: bool) -> CharTimes | None:
        """The characters for the next ``chunk_ms`` of audio (None: none this time; the span
        carries over to the next message). ``last``: the unit's audio ends here."""
        self._audio_ms += chunk_ms
        speech_ms = max(0.0, self._audio_ms - self._lead_ms)
        n = len(self._chars)
        if last:
            upto = n
        else:
            expected = max(self._expected_ms, speech_ms / _HOLD_FRACTION)
            target = self._total_weight * min(speech_ms / expected, _HOLD_FRACTION)
            upto = self._released
            while upto < n - 1 and self._cum[upto] <= target:
                upto += 1
        if upto <= self._released:
            return None
        chars = self._chars[self._released : upto]
        weights = self._weights[self._released : upto]
        self._released = upto
        span = self._audio_ms - self._span_start_ms
        silent = min(max(0.0, self._lead_ms - self._span_start_ms), span)
        self._span_start_ms = self._audio_ms
        return _layout(chars, weights, span, silent)


class WordTime(msgspec.Struct, frozen=True):
    word: str
    start_ms: int
    end_ms: int


def word_times(raw: str, total_ms: float, lead_ms: float = 0.0) -> list[WordTime]:
    """Words of ``raw`` with start and end times, its characters spread over ``total_ms``
    after its first ``lead_ms`` (a pause's silence)."""
    chars = list(raw)
    layout = _layout(chars, [char_weight(c) for c in chars], total_ms, min(lead_ms, total_ms))
    out: list[WordTime] = []
    word: list[str] = []
    start = end = 0
    for c, s, d in zip(layout.chars, layout.charStartTimesMs, layout.charDurationsMs, strict=True):
        if c.isspace():
            if word:
                out.append(WordTime("".join(word), start, end))
                word = []
            continue
        if not word:
            start = s
        word.append(c)
        end = s + d
    if word:
        out.append(WordTime("".join(word), start, end))
    return out


class UnitAligners:
    """ElevenLabs' two alignments of one unit: ``alignment`` over the text the client sent
    (the unit's raw text), ``normalizedAlignment`` over the text spoken (after the
    pronunciation dictionaries and normalisation, with the raw text's trailing whitespace so
    that units join up). Where the two texts are the same, one aligner serves both."""

    def __init__(self, raw: str, spoken: str, lead_ms: float = 0.0) -> None:
        self.raw = ChunkAligner(raw, lead_ms)
        self.normalized: ChunkAligner | None = None
        if spoken != " ".join(raw.split()):
            self.normalized = ChunkAligner(spoken + raw[len(raw.rstrip()) :], lead_ms)

    def take(self, chunk_ms: float, *, last: bool) -> tuple[CharTimes | None, CharTimes | None]:
        """(alignment, normalized alignment) for the next ``chunk_ms`` of audio."""
        times = self.raw.take(chunk_ms, last=last)
        if self.normalized is None:
            return times, times
        return times, self.normalized.take(chunk_ms, last=last)
