"""The baseline's HTTP face: ``POST /v1/audio/speech`` (pcm, streamed), ``/ready``, ``/health``.

The request contract is orpheus-serve's (OpenAI's, plus an optional ``max_tokens``), so
the same load generator drives both servers. Only ``response_format=pcm`` with
``stream_format=audio`` is served: the comparison is about generating audio, not
encoding it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from bench.compare.baseline.decoder import ReferenceStreamDecoder
from bench.compare.baseline.engine import max_tokens_for, prompt_ids, sampling_params
from common.config.llm import LLMConfig
from shm.messages import UNDECODABLE

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("bench.compare.baseline")


class SpeechBody(msgspec.Struct, kw_only=True):
    input: str
    model: str = "tts-1"
    voice: str = "tara"
    response_format: str = "mp3"
    stream_format: str = "audio"
    speed: float = 1.0
    max_tokens: int | None = None


_body_decoder = msgspec.json.Decoder(SpeechBody)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class BaselineServer:
    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: PreTrainedTokenizerBase,
        snac: torch.nn.Module,
        device: torch.device,
        config: LLMConfig,
        *,
        keep_zero_filter_bug: bool = False,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._snac = snac
        self._device = device
        self._config = config
        self._keep_zero_filter_bug = keep_zero_filter_bug
        self._ids = itertools.count()
        self.active = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/health", self.ready)
        return app

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "active_streams": self.active})

    async def speech(self, request: web.Request) -> web.StreamResponse:
        try:
            body = _body_decoder.decode(await request.read())
        except UNDECODABLE as exc:
            return _error(400, f"bad request body: {exc}")
        if body.response_format != "pcm" or body.stream_format != "audio":
            return _error(400, "the baseline serves response_format=pcm, stream_format=audio")
        if not body.input.strip():
            return _error(400, "input is empty")
        # The package knows model voices only (tara, leah, ...): no OpenAI aliases here; the
        # load generator sends a model voice to both servers.
        ids = prompt_ids(self._tokenizer, body.voice, body.input)
        room = self._config.max_model_len - len(ids)
        if room < 1:
            return _error(413, "input too long for max_model_len")
        fixed = body.max_tokens is not None
        if body.max_tokens is not None:
            max_tokens = min(body.max_tokens, room)
        else:
            max_tokens = max_tokens_for(self._config, body.input, len(ids))
        params = sampling_params(self._config, max_tokens, fixed=fixed)
        return await self._stream(request, ids, params)

    async def _stream(
        self, request: web.Request, ids: list[int], params: object
    ) -> web.StreamResponse:
        from vllm.inputs import TokensPrompt

        decoder = ReferenceStreamDecoder(
            self._snac, self._device, keep_zero_filter_bug=self._keep_zero_filter_bug
        )
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        request_id = f"baseline-{next(self._ids)}"
        self.active += 1
        try:
            outputs = self._engine.generate(TokensPrompt(prompt_token_ids=ids), params, request_id)  # type: ignore[arg-type]
            # aclosing: a client that goes away closes the generator, which aborts the request.
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    for token in out.outputs[0].token_ids:
                        # The reference decodes inline, in the event loop, one window per call.
                        pcm = decoder.push(token)
                        if pcm is None:
                            continue
                        if not resp.prepared:
                            await resp.prepare(request)
                        await resp.write(pcm)
        except (ConnectionResetError, OSError) as exc:
            log.debug("%s: client went away: %s", request_id, exc)
            return resp
        except Exception as exc:
            if resp.prepared:
                raise
            log.exception("%s failed", request_id)
            return _error(500, f"generation failed: {exc}", "server_error")
        finally:
            self.active -= 1
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write_eof()
        return resp
