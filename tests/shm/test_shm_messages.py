"""Control messages and ring payloads survive a msgpack round trip unchanged."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shm.messages import (
    ClusterStatus,
    EngineStatus,
    Heartbeat,
    LlmAppendText,
    LlmCancel,
    LlmSubmit,
    SamplingOverrides,
    WorkerReady,
    control_encoder,
    llm_control_decoder,
    orchestrator_decoder,
    status_decoder,
)
from shm.records import (
    StreamEnd,
    StreamError,
    end_decoder,
    error_decoder,
    gateway_of,
    make_stream_id,
    record_encoder,
)

ids = st.integers(0, (1 << 63) - 1)
floats = st.none() | st.floats(0.0, 5.0, allow_nan=False)
overrides = st.builds(
    SamplingOverrides,
    temperature=floats,
    top_p=floats,
    repetition_penalty=floats,
    max_tokens=st.none() | st.integers(1, 10_000),
    seed=st.none() | st.integers(0, 2**31),
    top_k=st.none() | st.integers(0, 2**31),
)
control = st.one_of(
    st.builds(LlmSubmit, stream_id=ids, text=st.text(), voice=st.text(), sampling=overrides,
              text_open=st.booleans()),
    st.builds(LlmAppendText, stream_id=ids, text=st.text(), final=st.booleans()),
    st.builds(LlmCancel, stream_id=ids, reason=st.text()),
)  # fmt: skip


@given(control)
def test_control_roundtrip(msg) -> None:
    assert llm_control_decoder.decode(control_encoder.encode(msg)) == msg


@given(st.builds(WorkerReady, role=st.text(), pid=st.integers(1, 2**22), detail=st.text())
       | st.builds(Heartbeat, role=st.text(), pid=st.integers(1, 2**22),
                   active_streams=st.integers(0, 10_000)))  # fmt: skip
def test_orchestrator_roundtrip(msg) -> None:
    assert orchestrator_decoder.decode(control_encoder.encode(msg)) == msg


@given(st.builds(ClusterStatus,
                 engines=st.lists(st.builds(EngineStatus, ready=st.booleans(),
                                            generation=st.integers(0, 1000)),
                                  min_size=1, max_size=8).map(tuple),
                 codec_ready=st.booleans(), draining=st.booleans(),
                 codec_generation=st.integers(0, 1000)))  # fmt: skip
def test_status_roundtrip(msg) -> None:
    assert status_decoder.decode(control_encoder.encode(msg)) == msg


@given(st.builds(StreamEnd, reason=st.text(), frames=st.integers(0, 10**6),
                 tokens=st.integers(0, 10**7), invalid_tokens_prevented=st.integers(0, 10**6)))  # fmt: skip
def test_end_roundtrip(msg) -> None:
    assert end_decoder.decode(record_encoder.encode(msg)) == msg


@given(st.builds(StreamError, code=st.text(), message=st.text(), status=st.integers(100, 599)))
def test_error_roundtrip(msg) -> None:
    assert error_decoder.decode(record_encoder.encode(msg)) == msg


@given(st.integers(0, 0xFFFF), st.integers(0, (1 << 48) - 1))
def test_stream_id_routes_to_its_gateway(gateway: int, counter: int) -> None:
    assert gateway_of(make_stream_id(gateway, counter)) == gateway
