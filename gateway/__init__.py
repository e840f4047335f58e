"""The gateway: HTTP (OpenAI, ElevenLabs), WebSocket (vLLM-Omni, ElevenLabs, Baseten) and ZeroMQ
front ends of orpheus-serve.

Process entry point: ``main`` (``gateway.main.run``). The core, each module with one job:

- ``service``: ``Gateway``, the process's state: admission, streams, cluster, watchdog, drain
- ``requests``: the owner of a request's life (``RequestTracker``: admit, track, finish; the
  ``ActiveRequest`` a front end drives: its stream, outcome, time to first audio); how a
  request ended
- ``link``: every write to a client, one ``ClientLink`` per connection (``ClientLinks``):
  the stall watchdog's clock, the audio bytes, the abort; audio that outlives its unit too
- ``readiness``: whether the gateway can take a stream (``/ready``, admission's gate)
- ``streams`` / ``pcm_pump``: PCM ring records routed into bounded per-stream buffers (the
  registry carries audio and says when a stream leaves it; it sends nothing upstream)
- ``upstream``: a stream's life in the llm workers (``Upstream``, the one sender of its
  submit, appends and cancel, one control PUSH per engine)
- ``pauses``: a request's text cut at its break tags, its runs spoken in turn with the
  pauses' silence between them
- ``admission``, ``cluster``: slots and the queue (fair between keys); ClusterStatus
- ``shares``: each key's max-min fair share of a full node (admission's turns between keys)
- ``capacity``: each engine's real-time limit, learned from the streams' audio
- ``schemas``, ``voices``, ``errors``: request validation, voice names, JSON errors
- ``voice_languages``: the languages of the checkpoint and of each voice (a request's
  default language, and what the voice and model listings show)
- ``auth``, ``browser_guard``, ``listener``, ``malformed_http``: API keys, browsers, the
  socket and its limits, what aiohttp refuses before a handler
- ``audio``: the audio output (formats, streaming encoders, the output pipeline)
- ``jobs``: long-form speech as durable jobs (store, runner, routes)
- ``text``: how a request's text is read (normalisation, pronunciation dictionaries)
- ``cache``: the sentence audio cache (each synthesis unit's PCM, kept on the node and served
  again to a repeat; ``[cache]``); ``warm``: ``POST /v1/cache/warm``, filling it in spare
  capacity
- ``custom_voices``: the voices API; ``watermark``: ``POST /v1/watermark/detect``;
  ``metrics``: Prometheus metrics (no front end imports
  it); ``apis``: ``Api``, which front end served a request (the metrics' label)
- ``disclosure``: every audio answer says it is AI-generated and how it is marked (headers;
  the protocols' metadata messages take ``disclosure.watermark_of``)
- ``app``: the aiohttp application: each front end's routes in one loop

The front ends, one package each under ``frontends`` (``frontends.registry`` lists those on
HTTP): ``frontends.openai`` (``POST /v1/audio/speech``), ``frontends.omni`` (vLLM-Omni's
WebSocket), ``frontends.elevenlabs`` (WebSocket, HTTP, voice and model lists), ``frontends.baseten`` (WebSocket
and HTTP), ``frontends.zeromq`` (internal clients; the client library is
``orpheus_client.zmq_client``). What they share is beside
them: ``frontends.shared``, ``frontends.utterance`` (units spoken in order),
``frontends.text_units`` and ``frontends.alignment``. ``static/index.html``: the playground.

The API is documented in docs/api.md; the layout in docs/architecture.md.
"""
