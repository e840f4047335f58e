"""Fakes that drive :class:`llm_worker.service.LLMService` without vLLM's engine or a ring.

- :class:`FakeEngine`: the service's :class:`~llm_worker.stream.Engine`. ``add`` returns a
  collector that behaves like vLLM's ``RequestOutputCollector`` with DELTA outputs (deltas
  merge while unread; an exception put there is raised by ``get_nowait``). A test delivers a
  step's tokens with ``emit`` and then runs ``service.pump()``.
- :class:`MemorySink`: the service's :class:`~llm_worker.output.RecordSink`, in memory.
  ``full`` refuses records; ``timeouts`` is how many ``wait_put`` calls time out before the
  ring has room again.
- :class:`FakePrompts`: prompt ids that spell the text (``spoken`` reads it back).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from llm_worker.codes import frames_to_tokens
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.token_space import TokenSpace
from shm.records import (
    CODE_DTYPE,
    FRAME_CODES,
    RecordKind,
    StreamEnd,
    StreamError,
    end_decoder,
    error_decoder,
)

# -- engine ------------------------------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Output:
    outputs: list[Completion]
    finished: bool = False


class FakeCollector:
    def __init__(self) -> None:
        self.output: Output | Exception | None = None

    def put(self, item: Output | Exception) -> None:
        if self.output is None or isinstance(item, Exception):
            self.output = item
        elif isinstance(self.output, Output) and isinstance(item, Output):
            # vLLM's DELTA aggregation: the unread delta grows.
            self.output.outputs[0].token_ids.extend(item.outputs[0].token_ids)
            self.output.outputs[0].finish_reason = item.outputs[0].finish_reason
            self.output.finished = item.finished

    def get_nowait(self) -> Output | None:
        out, self.output = self.output, None
        if isinstance(out, Exception):
            raise out
        return out


@dataclass
class FakeRequest:
    request_id: str
    prompt: list[int]
    params: Any
    lora: Any
    collector: FakeCollector = field(default_factory=FakeCollector)


class FakeEngine:
    def __init__(self, space: TokenSpace | None = None) -> None:
        self.space = space or TokenSpace.full()
        """Like the real engine's: ``add`` records prompts as engine ids, ``emit`` takes
        engine ids."""
        self.requests: list[FakeRequest] = []
        """Every request added, in order."""
        self.live: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []
        self.add_error: BaseException | None = None
        """Raised by the next ``add`` (once)."""
        self.gate: asyncio.Event | None = None
        """If set, ``add`` waits for it (a request being added while other things happen)."""

    async def add(self, request_id: str, prompt: list[int], params: Any, lora: Any = None) -> Any:
        if self.gate is not None:
            await self.gate.wait()
        if (e := self.add_error) is not None:
            self.add_error = None
            raise e
        assert request_id not in self.live, "request ids are unique"
        req = FakeRequest(request_id, self.space.to_engine(prompt), params, lora)
        self.requests.append(req)
        self.live[request_id] = req
        return req.collector

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def emit(self, request_id: str, ids: list[int] | np.ndarray, finish: str | None = None) -> None:
        """Deliver new tokens of a request (``finish``: its finish reason, ending it)."""
        req = self.live[request_id]
        out = Output([Completion([int(t) for t in ids], finish)], finished=finish is not None)
        req.collector.put(out)
        if finish is not None:
            del self.live[request_id]

    def fail(self, request_id: str, error: Exception) -> None:
        self.live[request_id].collector.put(error)

    def current(self, stream_id: int) -> FakeRequest:
        """The stream's request in the engine now."""
        (req,) = [r for rid, r in self.live.items() if rid.startswith(f"{stream_id:x}-")]
        return req


# -- sink --------------------------------------------------------------------------------


class Rec(NamedTuple):
    kind: int
    stream_id: int
    seq: int
    payload: bytes


class MemorySink:
    def __init__(self, max_payload: int = 1 << 16) -> None:
        self.max_payload = max_payload
        self.staged: list[Rec] = []
        self.records: list[Rec] = []
        """Published records, in order."""
        self.publishes: list[int] = []
        """Records made visible by each publish that had any."""
        self.full = False
        self.timeouts = 0
        self.waits: list[tuple[int, int, int]] = []
        """(kind, stream id, seq) of every ``wait_put``."""

    def try_put(self, kind: int, stream_id: int, seq: int, payload: Any) -> bool:
        if self.full:
            return False
        self.staged.append(Rec(kind, stream_id, seq, bytes(memoryview(payload).cast("B"))))
        return True

    async def wait_put(self, kind: int, stream_id: int, seq: int, payload: Any) -> bool:
        self.publish()
        self.waits.append((kind, stream_id, seq))
        await asyncio.sleep(0)  # others may run while the producer waits
        if self.timeouts > 0:
            self.timeouts -= 1
            if self.timeouts == 0:
                self.full = False  # the consumer caught up just after this timeout
            return False
        self.full = False
        return self.try_put(kind, stream_id, seq, payload)

    def publish(self) -> None:
        if self.staged:
            self.records.extend(self.staged)
            self.publishes.append(len(self.staged))
            self.staged.clear()


@dataclass
class Received:
    """One stream's records as a consumer sees them."""

    codes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    end: StreamEnd | None = None
    end_seq: int = -1
    error: StreamError | None = None
    error_seq: int = -1
    after_end: int = 0

    @property
    def frames(self) -> np.ndarray:
        if not self.codes:
            return np.zeros((0, FRAME_CODES), np.int16)
        return np.concatenate([f for _, f in self.codes])

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.codes]


def received(records: list[Rec]) -> dict[int, Received]:
    out: dict[int, Received] = {}
    for r in records:
        got = out.setdefault(r.stream_id, Received())
        if got.end is not None or got.error is not None:
            got.after_end += 1
        elif r.kind == RecordKind.CODES:
            frames = np.frombuffer(r.payload, dtype=CODE_DTYPE).reshape(-1, FRAME_CODES)
            got.codes.append((r.seq, frames))
        elif r.kind == RecordKind.END:
            got.end, got.end_seq = end_decoder.decode(r.payload), r.seq
        elif r.kind == RecordKind.ERROR:
            got.error, got.error_seq = error_decoder.decode(r.payload), r.seq
    return out


def contiguous(got: Received) -> bool:
    """CODES seq counts frames with no gap or repeat, and END closes at that count."""
    seq = 0
    for s, frames in got.codes:
        if s != seq:
            return False
        seq += len(frames)
    return got.end is not None and got.end.frames == seq == got.end_seq


# -- prompts -----------------------------------------------------------------------------


class FakePrompts:
    """Prompt ids of ``"{voice}: {text}"`` with one id per character (code point)."""

    def build(self, voice: str, text: str) -> list[int]:
        return self._wrap(f"{voice}: {text}")

    def build_plain(self, text: str) -> list[int]:
        return self._wrap(text)

    def _wrap(self, text: str) -> list[int]:
        return [*T.PROMPT_PREFIX, T.BOS, *map(ord, text), *T.PROMPT_SUFFIX]


def spoken(prompt: list[int]) -> str:
    """The text of the last turn of a prompt built by :class:`FakePrompts`."""
    body = prompt[: -len(T.PROMPT_SUFFIX)]
    start = len(body) - 1 - body[::-1].index(T.BOS)
    return "".join(map(chr, body[start + 1 :]))


def audio(frames: np.ndarray) -> list[int]:
    """The audio token ids of ``frames`` ((n, 7) codes)."""
    return frames_to_tokens(frames).tolist()
