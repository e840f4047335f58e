"""Baseten's Orpheus HTTP mode at ``POST /v1/baseten/orpheus/predict``.

What LiveKit's Baseten plugin sends with ``model="orpheus"`` and an ``https://`` (here
``http://``) endpoint (``tts.synthesize()``), and what Baseten's Orpheus truss answers
(Baseten's endpoints end in ``/predict``)::

    POST /v1/baseten/orpheus/predict
    Authorization: Api-Key KEY
    {"prompt": "Hello there.", "voice": "tara", "temperature": 0.6, "language": "en"}

    200, then headerless int16 LE mono 24 kHz PCM, streamed as it is made

The plugin reads the whole body within 30 s (its ``ClientTimeout(total=30)``): a text whose
audio takes longer to make is cut off on its side. The body is spoken as one request, as
``POST /v1/audio/speech`` speaks its ``input`` (the llm_worker cuts long text into
sentences), and answered the same way (``gateway.frontends.openai.speech.respond``): the status is
decided by what comes first, an error is OpenAI-shaped JSON with its status (the plugin
raises ``APIStatusError`` on it), a client that leaves cancels the stream into vLLM.
``language`` is the text's (normalisation and sentence ends: ``gateway.voices.languages``);
``max_tokens`` is an upper bound the server's own length cap already
enforces (as on Baseten's WebSocket); other fields are ignored.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.apis import Api
from gateway.edge.auth import presented_key
from gateway.frontends.openai.speech import respond
from gateway.frontends.shared import Handler, read_body
from gateway.schemas import bad_request, build_params, sampling_overrides
from gateway.service import Gateway
from gateway.text.breaks import cap_ms
from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator

PATH = "/v1/baseten/orpheus/predict"
API = Api.BASETEN


class PredictRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The body; the values are checked by ``build_params`` (the sampling fields are
    ``SamplingFields``'; ``max_tokens``, Baseten's cap, is accepted and not used)."""

    prompt: str
    voice: str | None = None
    language: str | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None
    apply_text_normalization: str | None = None


_decoder = msgspec.json.Decoder(PredictRequest)


def predict_handler(gateway: Gateway) -> Handler:
    g = gateway.config.gateway

    async def predict(request: web.Request) -> web.StreamResponse:
        started_at = gateway.loop.time()
        body = await read_body(request, g.max_body_bytes)
        try:
            req = _decoder.decode(body)
        except msgspec.ValidationError as e:
            raise bad_request(str(e)) from None
        except msgspec.DecodeError as e:
            raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
        plan = await gateway.speech_text.plan(
            req.pronunciation_dictionary_locators,
            req.apply_text_normalization,
            presented_key(request),
            gateway.languages.resolve(req.language, req.voice),
        )
        params = build_params(
            gateway.voices,
            gateway.limits,
            text=req.prompt,
            voice=req.voice or None,
            max_chars=g.max_input_chars,
            text_param="prompt",
            sampling=sampling_overrides(req, length=False),
            text_plan=plan,
            max_break_ms=cap_ms(g.max_break_s),
        )
        return await respond(request, gateway, params, API, started_at)

    return predict
