"""One wire contract: the gateway refuses, before admission, everything the llm_worker would
refuse, with the same message (``common.limits``, ``common.voice_lookup.VoiceLookup``), and what it
admits the worker serves. Both processes' real functions, no server."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.config.llm import LLMConfig, VoiceSampling
from common.limits import RequestLimits, sampling_problem
from common.voice_lookup import VoiceLookup
from gateway.errors import APIError
from gateway.schemas import build_params
from gateway.voices.catalogue import VoiceCatalog
from llm_worker.model_info import ModelInfo
from llm_worker.requests import BadRequest, RequestPlan, plan_request
from shm.messages import LlmSubmit, SamplingOverrides, control_encoder, llm_control_decoder

INFO = ModelInfo(voices=("tara", "leo"), emotion_tags=(), source="test")
LORA = {"ada"}
CUSTOM = {"anna"}


def _is_lora(v: str) -> bool:
    return v in LORA


def _is_custom(v: str) -> bool:
    return v in CUSTOM


CATALOG = VoiceCatalog({}, list(INFO.voices), "tara", _is_lora, _is_custom)
WORKER_VOICES = VoiceLookup(INFO.voices, _is_lora, _is_custom)


def gateway_verdict(
    config: LLMConfig, voice: str, o: SamplingOverrides, text_open: bool
) -> SamplingOverrides | str:
    """What the gateway sends the worker, or the message of its 400."""
    try:
        p = build_params(
            CATALOG,
            RequestLimits.of(config),
            text="Hi.",
            voice=voice,
            max_chars=100,
            allow_empty=text_open,
            sampling=o,
            text_open=text_open,
        )
    except APIError as e:
        assert e.status == 400
        return e.message
    return p.sampling


def worker_verdict(
    config: LLMConfig, voice: str, o: SamplingOverrides, text_open: bool
) -> RequestPlan | str:
    """The worker's plan for ``LlmSubmit`` as it arrives over the control socket, or the
    message of its 400."""
    raw = control_encoder.encode(LlmSubmit(1, "Hi.", voice, o, text_open))
    submit = llm_control_decoder.decode(raw)
    assert isinstance(submit, LlmSubmit)
    try:
        return plan_request(submit, config, INFO, WORKER_VOICES)
    except BadRequest as e:
        return str(e)


def _near(*xs: float) -> list[float]:
    return [y for x in xs for y in (math.nextafter(x, -math.inf), x, math.nextafter(x, math.inf))]


EDGES = [*_near(0.0, 0.5, 1.0, 2.0), -0.0, 1e-300, 5.0, 10.0, math.nan, math.inf, -math.inf]
floats = st.none() | st.sampled_from(EDGES) | st.floats() | st.integers(-3, 12)
CAPS = (7, 350, 4096, 10_000)
INT_EDGES = [-1, 0, 1, 6, 7, 8, *CAPS, *(c + 1 for c in CAPS), 2**63 - 1, 2**63, 2**64 - 1]
ints = st.none() | st.sampled_from(INT_EDGES) | st.integers(-(2**63), 2**64 - 1)
overrides = st.builds(
    SamplingOverrides,
    temperature=floats,
    top_p=floats,
    repetition_penalty=floats,
    max_tokens=ints,
    seed=ints,
    top_k=ints,
)


@settings(max_examples=600, deadline=None)
@given(
    o=overrides,
    cap=st.sampled_from(CAPS),
    voice=st.sampled_from(["tara", "Leo", "nobody", "anna", "ADA"]),
    text_open=st.booleans(),
)
@example(o=SamplingOverrides(temperature=5.0), cap=4096, voice="tara", text_open=False)
@example(o=SamplingOverrides(repetition_penalty=10.0), cap=4096, voice="tara", text_open=False)
@example(o=SamplingOverrides(max_tokens=1), cap=4096, voice="tara", text_open=False)
@example(o=SamplingOverrides(max_tokens=4097), cap=4096, voice="tara", text_open=False)
@example(o=SamplingOverrides(max_tokens=70), cap=4096, voice="tara", text_open=True)
@example(o=SamplingOverrides(temperature=3.0), cap=4096, voice="nobody", text_open=False)
@example(o=SamplingOverrides(top_k=-1), cap=4096, voice="tara", text_open=False)
def test_the_gateway_and_the_worker_give_one_verdict(
    o: SamplingOverrides, cap: int, voice: str, text_open: bool
) -> None:
    config = LLMConfig(model="unused", max_tokens_cap=cap)
    gateway = gateway_verdict(config, voice, o, text_open)
    worker = worker_verdict(config, voice, o, text_open)
    if isinstance(gateway, str) or isinstance(worker, str):
        assert gateway == worker, "refused by both, with the same message"
        return
    # Both accept: and the request the gateway sends is the one the worker serves.
    sent = worker_verdict(config, voice, gateway, text_open)
    assert sent == worker
    assert gateway == o, "the gateway passes the values on unchanged (1 as 1.0)"


def test_the_old_gateway_ranges_are_refused_before_admission() -> None:
    """The ranges the gateway used to admit and the worker refused (temperature up to 5,
    repetition_penalty up to 10, max_tokens from 1 and to 2**20)."""
    config = LLMConfig(model="unused")
    for o, message in (
        (SamplingOverrides(temperature=5.0), "Expected `float` <= 2.0 - at `$.temperature`"),
        (
            SamplingOverrides(repetition_penalty=10.0),
            "Expected `float` <= 2.0 - at `$.repetition_penalty`",
        ),
        (
            SamplingOverrides(repetition_penalty=0.1),
            "Expected `float` >= 0.5 - at `$.repetition_penalty`",
        ),
        (SamplingOverrides(max_tokens=1), "Expected `int` >= 7 - at `$.max_tokens`"),
        (SamplingOverrides(max_tokens=1 << 20), "Expected `int` <= 4096 - at `$.max_tokens`"),
    ):
        assert gateway_verdict(config, "tara", o, False) == message
        assert worker_verdict(config, "tara", o, False) == message


@pytest.mark.parametrize(
    ("sampling", "problem"),
    [
        (VoiceSampling(), None),
        (VoiceSampling(temperature=2.5), "Expected `float` <= 2.0 - at `$.temperature`"),
        (VoiceSampling(top_p=0.0), "Expected `float` > 0.0 - at `$.top_p`"),
        (
            VoiceSampling(repetition_penalty=3.0),
            "Expected `float` <= 2.0 - at `$.repetition_penalty`",
        ),
        (VoiceSampling(top_k=-1), "Expected `int` >= 0 - at `$.top_k`"),
    ],
)
def test_a_voices_default_sampling_is_within_the_limits(
    sampling: VoiceSampling, problem: str | None
) -> None:
    """The worker checks a request's overrides only: the defaults are the configuration's
    check (orchestrator.settings.validate)."""
    from orchestrator.settings import ConfigError, load_config

    assert sampling_problem(sampling) == problem
    if problem is None:
        return
    fields: dict[str, Any] = msgspec.structs.asdict(sampling)
    for layer in ({"llm": {"sampling": fields}}, {"llm": {"voice_sampling": {"leo": fields}}}):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            load_config(None, layer, {})
    with pytest.raises(ConfigError, match="max_tokens_cap"):
        load_config(None, {"llm": {"max_tokens_cap": 6}}, {})
