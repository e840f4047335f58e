"""The limits of one utterance request's sampling fields: the one definition of them.

Both processes check a request's ``SamplingOverrides`` with :meth:`RequestLimits.check`: the
gateway before admission (``gateway.schemas.build_params``), so a request that can never be
served is a 400 even while the server is full, never a 429; the llm_worker again when the
stream starts (``llm_worker.requests.plan_request``), the last line of defence against
ZeroMQ internal clients that bypass a gateway, and bugs. Same function, same verdict, same
message (msgspec's wording, as every other field's: ``Expected `float` <= 2.0 - at
`$.temperature```) and the field it names.

The ranges (docs/api.md, *Sampling limits*):

- ``temperature`` 0..2: vLLM's ``SamplingParams`` refuses more (``temperature must be in
  [0, 2]``); 0 is greedy.
- ``top_p`` (0, 1]: vLLM's range.
- ``top_k`` 0 or more: 0 is no limit (vLLM's ``-1`` is not taken: one way to say it), 1
  greedy; above the vocabulary it limits nothing.
- ``repetition_penalty`` 0.5..2: vLLM takes any positive value; this is the range the
  llm_worker has always served (docs/orpheus.md: at least 1.1 is needed for stable speech, and
  raising it makes speech faster; below 1 it rewards repeats, and loops are this model's
  most common failure).
- ``seed`` 0..2**63-1: a non-negative signed 64-bit integer (vLLM seeds a torch generator
  with it; segment ``i`` of a stream takes ``seed + i`` modulo 2**63).
- ``max_tokens`` ``FRAME_CODES``..``llm.max_tokens_cap``: fewer than one frame of codes is
  no audio at all; the cap bounds one generation (the server's own, not the client's).
  A fixed length fixes it for a complete text: not with ``text_open`` (ZeroMQ).

The voices' default sampling (``llm.sampling``, ``llm.voice_sampling``) must lie in the same
ranges; ``sampling_problem`` says what is wrong with one (the configuration's check).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from common.config.llm import LLMConfig, VoiceSampling
from orpheus_wire.sampling import SamplingFields
from shm.records import FRAME_CODES

TEMPERATURE_MAX = 2.0
REPETITION_PENALTY_MIN = 0.5
REPETITION_PENALTY_MAX = 2.0
SEED_MAX = 2**63 - 1
MAX_TOKENS_MIN = FRAME_CODES

RANGES: dict[str, Any] = {
    "max_tokens": Annotated[int, Meta(ge=MAX_TOKENS_MIN)],
    "seed": Annotated[int, Meta(ge=0, le=SEED_MAX)],
    "temperature": Annotated[float, Meta(ge=0.0, le=TEMPERATURE_MAX)],
    "top_p": Annotated[float, Meta(gt=0.0, le=1.0)],
    "repetition_penalty": Annotated[
        float, Meta(ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    ],
    "top_k": Annotated[int, Meta(ge=0)],
}
"""The range of each of ``SamplingFields``' fields (``orpheus_wire.sampling``), by name (a
field without one stops this module's import: ``SamplingRules`` below)."""

SamplingRules: type[msgspec.Struct] = msgspec.defstruct(
    "SamplingRules",
    [(f, RANGES[f] | None, None) for f in SamplingFields.__struct_fields__],
    kw_only=True,
    frozen=True,
    forbid_unknown_fields=True,
    module=__name__,
)
"""``SamplingFields`` with each field's range: what :meth:`RequestLimits.check` converts to."""

FIELDS = SamplingRules.__struct_fields__

TEXT_OPEN_MAX_TOKENS = "max_tokens fixes the length of a complete text: not with text_open"

S = TypeVar("S", bound=SamplingFields)


class LimitError(ValueError):
    """A sampling field outside its limits: ``message`` (as the client reads it) and
    ``param`` (the field it is about)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")


def _convert(values: dict[str, object]) -> Any:
    """``values`` checked against their ranges, as their fields' types (an int temperature
    as a float): a ``SamplingRules``."""
    try:
        return msgspec.convert(values, SamplingRules)
    except msgspec.ValidationError as e:
        m = _PATH_RE.search(str(e))
        raise LimitError(str(e), m.group(1) if m else None) from None


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The limits of this server's requests (they depend on its ``[llm]`` configuration)."""

    max_tokens_cap: int = LLMConfig().max_tokens_cap

    @classmethod
    def of(cls, llm: LLMConfig) -> RequestLimits:
        return cls(max_tokens_cap=llm.max_tokens_cap)

    def check(self, o: S, *, text_open: bool = False) -> S:
        """``o`` checked: ``o`` with its numbers as their fields' types (an int temperature
        as a float). LimitError for the first failure: the ranges (a field at a time, as
        msgspec reports it), then the cap of ``max_tokens``, then ``max_tokens`` with
        ``text_open``."""
        given = {f: v for f in FIELDS if (v := getattr(o, f)) is not None}
        r = _convert(given)
        max_tokens = r.max_tokens
        if max_tokens is not None:
            if max_tokens > self.max_tokens_cap:
                raise LimitError(
                    f"Expected `int` <= {self.max_tokens_cap} - at `$.max_tokens`", "max_tokens"
                )
            if text_open:
                raise LimitError(TEXT_OPEN_MAX_TOKENS, "max_tokens")
        return msgspec.structs.replace(o, **{f: getattr(r, f) for f in given})


def sampling_problem(s: VoiceSampling) -> str | None:
    """What is wrong with a voice's default sampling (None: it is within the limits)."""
    try:
        _convert(msgspec.structs.asdict(s))
    except LimitError as e:
        return e.message
    return None
