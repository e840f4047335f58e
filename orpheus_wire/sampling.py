"""The sampling fields a speech request may carry: declared here once, inherited by every
wire type that takes them (``gateway.frontends.openai.body.SpeechRequest`` over HTTP, long-form jobs,
``orpheus_wire.zeromq.Speak``, vLLM-Omni's ``session.config``, Baseten's messages) and by the
llm_worker's message (``shm.messages.SamplingOverrides``), which each front end's request
becomes by one conversion (``gateway.schemas.sampling_overrides``).

Their limits are ``common.limits``' (the llm_worker's, keyed by these names), checked by
``gateway.schemas.build_params``; the voices' defaults are ``common.config.llm.
VoiceSampling``. Every name but ``max_tokens`` and ``seed`` is a keyword of vLLM's
``SamplingParams``, which the llm_worker builds in one place
(``llm_worker.vllm_ext.sampling.plan.sampling_kwargs``: there the repetition penalty takes
vLLM's path or the worker's tensor penalty's). A new field goes at the end: these are
msgpack maps on the ZeroMQ wire, and an older client's messages must keep decoding.
"""

from __future__ import annotations

import msgspec


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Extensions to OpenAI's request (HTTP and ZeroMQ): per-request overrides of the voice's
    sampling, None keeping the voice's default."""

    max_tokens: int | None = None
    """Exact number of audio tokens (7 per 85 ms frame), at least 7, at most
    ``llm.max_tokens_cap``; None: the server caps the length by the text's. The length of
    one whole utterance: the streaming protocols, which speak their text unit by unit, and
    Baseten's requests (whose ``max_tokens`` is a cap, not a length) leave it out."""
    seed: int | None = None
    """Segment ``i`` of a stream samples with ``seed + i``; None: random."""
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens only; 0: no such limit, 1: greedy."""


LENGTH_FIELD = "max_tokens"
"""The field that fixes one whole utterance's length (see ``SamplingFields.max_tokens``)."""
