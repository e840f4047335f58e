"""From a ``LlmSubmit`` to the vLLM requests that speak it: validation, sampling, length caps.

Nothing here touches the engine: a request that fails validation is answered with a 400
before any engine work. The rules are the gateway's too (it checks them before admission):
the sampling fields' limits are ``common.limits``, the voice lookup and its message
``common.voice_lookup.VoiceLookup``; here they are the last line of defence (ZeroMQ internal clients
that bypass a gateway, a voice deleted after admission, bugs). One utterance becomes one or
more *segments* (pieces of text, :mod:`llm_worker.text`), each a vLLM request, generated in
order.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from common.config.llm import LLMConfig, VoiceSampling
from common.limits import SEED_MAX, LimitError, RequestLimits
from common.voice_lookup import VoiceKind, VoiceLookup
from llm_worker.model_info import ModelInfo
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling.plan import sampling_kwargs as engine_sampling
from shm.messages import LlmSubmit, SamplingOverrides
from shm.records import FRAME_CODES

EMPTY_TEXT = "empty_input"
"""The error code of a request with no text to speak: the gateway's for a blank input."""


class BadRequest(ValueError):
    """The request cannot be served as sent (HTTP 400); nothing was started. ``code`` is the
    error code the client sees."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


class RequestPlan(msgspec.Struct, frozen=True):
    """Everything about one utterance that does not depend on its text."""

    voice: str
    kind: VoiceKind
    """Which kind of voice it is (``VoiceLookup``): the model's, a LoRA or a custom voice."""
    sampling: VoiceSampling
    """The voice's defaults with the request's overrides (:func:`resolve_sampling`), made
    ``SamplingParams`` keywords once per stream
    (:func:`llm_worker.vllm_ext.sampling.plan.sampling_kwargs`)."""
    seed: int | None
    total_tokens: int | None
    """Exact audio tokens for the whole stream (the client fixed the length): end of speech
    is then ignored. None: each segment stops at end of speech or its length cap."""


def _check(ok: bool, message: str, code: str = "bad_request") -> None:
    if not ok:
        raise BadRequest(message, code)


def voice_of(submit: LlmSubmit, config: LLMConfig) -> str:
    """The voice a request names, as voices are matched (stripped, lower case)."""
    return (submit.voice or config.default_voice).strip().lower()


def plan_request(
    submit: LlmSubmit, config: LLMConfig, info: ModelInfo, voices: VoiceLookup | None = None
) -> RequestPlan:
    """Validate ``submit`` and resolve its sampling: the voice's defaults, then overrides.

    Checked in the gateway's order (``gateway.schemas.build_params``), so a request with
    several faults gets the same 400 from both: the sampling fields (``RequestLimits``), the
    text, the voice (``voices``: the model's, LoRA and custom voices, looked up in the one
    order; None: the model's voices only). The voices' defaults are within the limits (the
    configuration's check, ``common.limits.sampling_problem``)."""
    try:
        o: SamplingOverrides = RequestLimits.of(config).check(
            submit.sampling, text_open=submit.text_open
        )
    except LimitError as e:
        raise BadRequest(e.message) from None
    _check(
        submit.text_open or bool(submit.text.strip()),
        "empty text: there is nothing to say",
        EMPTY_TEXT,
    )
    lookup = voices if voices is not None else VoiceLookup(info.voices)
    voice = voice_of(submit, config)
    kind = lookup.kind(voice)
    if kind is None:
        raise BadRequest(lookup.unknown(submit.voice))
    return RequestPlan(
        voice=voice,
        kind=kind,
        sampling=resolve_sampling(config.voice_sampling.get(voice, config.sampling), o),
        seed=o.seed,
        total_tokens=o.max_tokens,
    )


_VOICE_FIELDS = VoiceSampling.__struct_fields__


def resolve_sampling(base: VoiceSampling, o: SamplingOverrides) -> VoiceSampling:
    """``base`` (a voice's defaults) with the fields ``o`` sets (None keeps the default)."""
    given = {f: v for f in _VOICE_FIELDS if (v := getattr(o, f)) is not None}
    return msgspec.structs.replace(base, **given) if given else base


def _round_up_to_frame(n: int) -> int:
    return -(-n // FRAME_CODES) * FRAME_CODES


def length_cap(config: LLMConfig, chars: int) -> int:
    """Audio tokens a segment of ``chars`` characters may produce before it is cut.

    Runaway generations are this model's most common failure: the cap grows with the
    text (``max_tokens_per_char``), has a floor for short texts and a ceiling, and is a
    whole number of frames.
    """
    cap = max(config.min_max_tokens, math.ceil(chars * config.max_tokens_per_char))
    ceiling = config.max_tokens_cap // FRAME_CODES * FRAME_CODES
    return min(_round_up_to_frame(cap), ceiling)


def split_budget(total: int, chars: list[int]) -> list[int]:
    """Share ``total`` tokens among segments in proportion to their text, in whole frames
    (the last segment takes the remainder). Sums to ``total``."""
    if not chars:
        return []
    weight = sum(chars)
    out, used = [], 0
    for n in chars[:-1]:
        share = (total * n // weight) // FRAME_CODES * FRAME_CODES
        out.append(share)
        used += share
    out.append(total - used)
    return out


def segment_params(
    config: LLMConfig,
    plan: RequestPlan,
    index: int,
    chars: int,
    prompt_len: int,
    budget: int | None = None,
    sampling_kwargs: dict[str, Any] | None = None,
    stop_id: int = T.END_OF_SPEECH,
) -> SamplingParams:
    """``SamplingParams`` of segment ``index`` of ``plan``.

    The segment has ``chars`` characters of text and a prompt of ``prompt_len`` ids;
    ``budget`` is its exact share of ``plan.total_tokens`` (None: capped by text length).
    ``stop_id`` is end-of-speech as the engine numbers it (the output head's token space).
    ``sampling_kwargs`` are the stream's sampling keywords, built once by the sampling
    package (:func:`~llm_worker.vllm_ext.sampling.plan.sampling_kwargs`, through the
    service's hooks); None: ``plan.sampling`` with vLLM's built-in repetition penalty.
    """
    room = config.max_model_len - prompt_len
    if room < FRAME_CODES:
        raise BadRequest(
            f"the prompt ({prompt_len} tokens) leaves no room for audio within "
            f"max_model_len {config.max_model_len}"
        )
    fixed = budget is not None
    max_tokens = budget if budget is not None else length_cap(config, chars)
    max_tokens = min(max_tokens, room // FRAME_CODES * FRAME_CODES)
    if max_tokens < 1:
        raise BadRequest("max_tokens leaves this segment no audio token")
    if sampling_kwargs is None:
        sampling_kwargs = engine_sampling(plan.sampling)
    return SamplingParams(
        **sampling_kwargs,
        max_tokens=max_tokens,
        # A fixed length ignores end of speech: min_tokens masks the stop ids until the
        # budget is spent (so 128258 is never sampled and no frame is lost to it).
        min_tokens=max_tokens if fixed else 0,
        stop_token_ids=[stop_id],
        seed=None if plan.seed is None else (plan.seed + index) % (SEED_MAX + 1),
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )
