"""The gateway: HTTP (OpenAI, ElevenLabs), WebSocket (vLLM-Omni, ElevenLabs, Baseten) and ZeroMQ
front ends of orpheus-serve.

Process entry point: ``main`` (``gateway.main.run``). A request's path, one room each:

1. ``edge``: everything before a handler (the socket and its limits, malformed HTTP,
   browsers, API keys).
2. ``frontends``: one package per protocol turns its request into units of text
   (``frontends.registry`` lists those on HTTP; what they share is beside them:
   ``frontends.shared``, ``frontends.utterance``, ``frontends.text_units``,
   ``frontends.alignment``); ``schemas``: the speech parameters every front end builds
   (``schemas.build_params``: every field rule, the same 400s for every protocol), with
   ``voices`` (the catalogue, languages, custom voices) and ``text`` (pauses,
   normalisation, pronunciation dictionaries).
3. ``admission``: who may speak now (slots, the learned capacity, fair shares between keys,
   readiness, the cluster view); ``cache`` answers a repeated unit without speaking it.
4. ``requests``: the owner of a request's life (``RequestTracker``: admit, track, finish; the
   ``ActiveRequest`` a front end drives); ``upstream``: its stream's life in the llm workers
   (the one sender of its submit, appends and cancel); ``streams`` / ``pcm_pump``: the PCM
   ring's records routed into bounded per-stream buffers.
5. ``audio``: the output (formats, streaming encoders); ``link``: every write to a client,
   one ``ClientLink`` per connection (the stall watchdog's clock, the abort);
   ``disclosure``: every audio answer says it is AI-generated, and the watermark detector.

Around them: ``service`` (``Gateway``, the process's state, its background tasks and drain),
``app`` (the aiohttp application: each front end's routes in one loop), ``jobs`` (long-form
speech as durable jobs), ``warm`` (``POST /v1/cache/warm``, filling the cache in spare
capacity), ``metrics`` (Prometheus; no front end imports it), ``apis`` (``Api``, which front
end served a request: the metrics' label), ``errors`` (JSON errors), ``rpc`` (request/reply
with a worker's ROUTER: a custom voice's encoding, the watermark's reading, LoRA admin). ``static/index.html``:
the playground.

The API is documented in docs/api.md; the layout in docs/architecture.md.
"""
