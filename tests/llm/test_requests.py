"""Request validation and sampling: voices, per-voice defaults, overrides, length caps."""

from __future__ import annotations

import msgspec
import pytest
from vllm.sampling_params import RequestOutputKind

from common.config.llm import LLMConfig, VoiceSampling
from llm_worker.model_info import ModelInfo
from llm_worker.requests import (
    BadRequest,
    length_cap,
    plan_request,
    segment_params,
    split_budget,
)
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling import ModelRunner, SamplingPlan, sampling_kwargs
from shm.messages import LlmSubmit, SamplingOverrides

INFO = ModelInfo(voices=("tara", "leo"), emotion_tags=("laugh",), source="test")
CONFIG = LLMConfig(
    model="unused",
    sampling=VoiceSampling(temperature=0.6, top_p=0.8, repetition_penalty=1.1),
    voice_sampling={"leo": VoiceSampling(temperature=0.4, top_p=0.9, repetition_penalty=1.2)},
    max_model_len=1024,
)


def test_voice_defaults_and_overrides() -> None:
    tara = plan_request(LlmSubmit(1, "Hi.", "Tara"), CONFIG, INFO)
    assert tara.voice == "tara"
    assert tara.sampling == VoiceSampling(temperature=0.6, top_p=0.8, repetition_penalty=1.1)
    leo = plan_request(LlmSubmit(2, "Hi.", "leo"), CONFIG, INFO)
    assert leo.sampling == VoiceSampling(temperature=0.4, top_p=0.9, repetition_penalty=1.2)
    o = SamplingOverrides(temperature=0.9, repetition_penalty=1.3, seed=5, max_tokens=70)
    custom = plan_request(LlmSubmit(3, "Hi.", "leo", o), CONFIG, INFO)
    assert custom.sampling == VoiceSampling(temperature=0.9, top_p=0.9, repetition_penalty=1.3)
    assert (custom.seed, custom.total_tokens) == (5, 70)
    assert custom.sampling.top_k == 0, "a field the request leaves out keeps the voice's"


def test_every_voice_default_is_a_request_override_and_a_vllm_keyword() -> None:
    """The plan spreads ``VoiceSampling`` into ``SamplingParams``: each of its fields is one of
    the wire's ``SamplingFields`` (a request overrides it) and a ``SamplingParams`` keyword."""
    from vllm import SamplingParams

    from orpheus_wire.sampling import SamplingFields

    for f in VoiceSampling.__struct_fields__:
        assert f in SamplingFields.__struct_fields__
        assert hasattr(SamplingParams(), f)


def test_top_k_reaches_the_segments_params() -> None:
    """top_k: the voice's default (0, no limit), or the request's, in every segment."""
    plan = plan_request(LlmSubmit(1, "Hi.", "tara"), CONFIG, INFO)
    assert segment_params(CONFIG, plan, index=0, chars=3, prompt_len=20).top_k == 0
    plan = plan_request(_o(top_k=1), CONFIG, INFO)
    assert plan.sampling.top_k == 1
    for i in range(3):
        assert segment_params(CONFIG, plan, index=i, chars=3, prompt_len=20).top_k == 1
    cfg = msgspec.structs.replace(CONFIG, voice_sampling={"leo": VoiceSampling(top_k=40)})
    leo = plan_request(LlmSubmit(1, "Hi.", "leo"), cfg, INFO)
    assert segment_params(cfg, leo, index=0, chars=3, prompt_len=20).top_k == 40


def _o(**kw: object) -> LlmSubmit:
    return LlmSubmit(1, "Hi.", "tara", SamplingOverrides(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("submit", "message"),
    [
        (
            LlmSubmit(1, "Hi.", "nobody"),
            "unknown voice 'nobody'; voices: tara, leo "
            "(and the custom voices listed by GET /v1/audio/voices)",
        ),
        (LlmSubmit(1, "  \n ", "tara"), "empty text: there is nothing to say"),
        # The limits are common.limits' (the gateway's too), in msgspec's words.
        (_o(temperature=-1.0), "Expected `float` >= 0.0 - at `$.temperature`"),
        (_o(temperature=float("nan")), "Expected `float` >= 0.0 - at `$.temperature`"),
        (_o(temperature=2.01), "Expected `float` <= 2.0 - at `$.temperature`"),
        (_o(top_p=0.0), "Expected `float` > 0.0 - at `$.top_p`"),
        (_o(repetition_penalty=9.0), "Expected `float` <= 2.0 - at `$.repetition_penalty`"),
        (_o(repetition_penalty=0.4), "Expected `float` >= 0.5 - at `$.repetition_penalty`"),
        (_o(max_tokens=6), "Expected `int` >= 7 - at `$.max_tokens`"),
        (_o(max_tokens=10**6), "Expected `int` <= 4096 - at `$.max_tokens`"),
        (_o(seed=-1), "Expected `int` >= 0 - at `$.seed`"),
        (_o(top_k=-1), "Expected `int` >= 0 - at `$.top_k`"),
        (
            LlmSubmit(1, "Hi.", "tara", SamplingOverrides(max_tokens=70), text_open=True),
            "max_tokens fixes the length of a complete text: not with text_open",
        ),
    ],
)
def test_bad_requests(submit: LlmSubmit, message: str) -> None:
    with pytest.raises(BadRequest) as e:
        plan_request(submit, CONFIG, INFO)
    assert str(e.value) == message


def test_the_limits_are_inclusive_and_the_cap_is_the_configurations() -> None:
    ok = _o(temperature=2.0, top_p=1.0, repetition_penalty=0.5, max_tokens=4096, seed=2**63 - 1)
    plan = plan_request(ok, CONFIG, INFO)
    assert (plan.sampling.temperature, plan.sampling.repetition_penalty, plan.total_tokens) == (
        2.0,
        0.5,
        4096,
    )
    assert (
        plan_request(_o(temperature=0, repetition_penalty=2), CONFIG, INFO).sampling.temperature
        == 0.0
    )
    assert plan_request(_o(max_tokens=7), CONFIG, INFO).total_tokens == 7
    big = msgspec.structs.replace(CONFIG, max_tokens_cap=8000)
    assert plan_request(_o(max_tokens=8000), big, INFO).total_tokens == 8000
    with pytest.raises(BadRequest, match="<= 8000"):
        plan_request(_o(max_tokens=8001), big, INFO)


def test_open_text_may_start_empty() -> None:
    assert plan_request(LlmSubmit(1, "", "tara", text_open=True), CONFIG, INFO).voice == "tara"


def test_length_cap_grows_with_text_within_bounds() -> None:
    cfg = LLMConfig(model="x", max_tokens_per_char=7.0, min_max_tokens=350, max_tokens_cap=4096)
    assert length_cap(cfg, 1) == 350  # the floor, rounded up to whole frames
    assert length_cap(cfg, 100) == 700
    assert length_cap(cfg, 10_000) == 4095  # the cap, in whole frames
    assert all(length_cap(cfg, n) % 7 == 0 for n in range(0, 1000, 37))


def test_split_budget() -> None:
    assert split_budget(70, [10, 10]) == [35, 35]
    assert split_budget(84, [30, 10, 20]) == [42, 14, 28]
    assert split_budget(50, [1, 1, 1]) == [14, 14, 22]
    for total in (7, 70, 333):
        parts = split_budget(total, [5, 17, 3, 40])
        assert sum(parts) == total and all(p % 7 == 0 for p in parts[:-1])


def test_segment_params_natural_end() -> None:
    plan = plan_request(LlmSubmit(1, "Hi.", "tara", SamplingOverrides(seed=9)), CONFIG, INFO)
    p = segment_params(CONFIG, plan, index=2, chars=100, prompt_len=20)
    assert p.max_tokens == 700 and p.min_tokens == 0
    assert p.stop_token_ids == [T.END_OF_SPEECH] and not p.ignore_eos
    assert p.seed == 11, "each segment gets its own reproducible seed"
    assert p.detokenize is False and p.output_kind == RequestOutputKind.DELTA
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.6, 0.8, 1.1)


def test_segment_params_fixed_length_ignores_end_of_speech() -> None:
    plan = plan_request(LlmSubmit(1, "Hi.", "tara", SamplingOverrides(max_tokens=84)), CONFIG, INFO)
    p = segment_params(CONFIG, plan, index=0, chars=3, prompt_len=20, budget=84)
    assert p.max_tokens == 84 and p.min_tokens == 84, "stop ids masked until the budget is spent"


def test_segment_params_respect_max_model_len_and_sampling_kwargs() -> None:
    plan = plan_request(LlmSubmit(1, "Hi.", "tara"), CONFIG, INFO)
    p = segment_params(CONFIG, plan, 0, chars=500, prompt_len=1000)
    assert p.max_tokens == 21  # what fits in max_model_len, whole frames
    with pytest.raises(BadRequest, match="max_model_len"):
        segment_params(CONFIG, plan, 0, chars=5, prompt_len=1020)
    v1 = SamplingPlan(runner=ModelRunner.V1, tensor_penalty=True, constrain_audio=False)
    ours = sampling_kwargs(plan.sampling, v1)
    p = segment_params(CONFIG, plan, 0, chars=5, prompt_len=20, sampling_kwargs=ours)
    assert p.repetition_penalty == 1.0, "the tensor penalty's: vLLM's list path stays off"
    assert p.extra_args == {"orpheus": {"repetition_penalty": 1.1}}
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.8, 0)


def test_sampling_kwargs_name_the_penalty_once() -> None:
    """Every sampling field reaches vLLM once: the penalty on one path, never both."""
    vs = VoiceSampling(temperature=0.5, top_p=0.9, repetition_penalty=1.3, top_k=7)
    builtin = sampling_kwargs(vs)
    assert builtin == msgspec.structs.asdict(vs)
    v2 = SamplingPlan(runner=ModelRunner.V2, tensor_penalty=False, constrain_audio=False)
    assert sampling_kwargs(vs, v2) == builtin
    v1 = SamplingPlan(runner=ModelRunner.V1, tensor_penalty=True, constrain_audio=False)
    ours = sampling_kwargs(vs, v1)
    assert ours == {
        **builtin,
        "repetition_penalty": 1.0,
        "extra_args": {"orpheus": {"repetition_penalty": 1.3}},
    }
