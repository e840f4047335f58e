"""The gateway: HTTP (OpenAI, ElevenLabs), WebSocket (vLLM-Omni, ElevenLabs, Baseten) and ZeroMQ
front ends of orpheus-serve.

Process entry point: ``gateway.main.run``. Modules, each with one job:

- ``service``: ``Gateway``, the process's state: admission, streams, cluster, watchdog, drain
- ``session``: one admitted stream as a front end drives it, and how it ended (outcome)
- ``readiness``: whether the gateway can take a stream (``/ready``, admission's gate)
- ``streams`` / ``pcm_pump``: PCM ring records routed into bounded per-stream buffers
- ``admission``, ``cluster``, ``upstream``: slots and queue; ClusterStatus; control PUSH
- ``schemas``, ``voices``, ``errors``: request validation, voice names, JSON errors
- ``auth``: the API-key check of every front end (HTTP middleware, ZeroMQ)
- ``encoders``, ``audio_out``, ``sse``: streaming encoders, resampling, G.711; SSE events
- ``app``, ``speech_http``: the aiohttp application and the OpenAI handler
- ``omni_ws``, ``elevenlabs``, ``baseten_ws``: the voice agents' streaming protocols, on
  ``text_units`` (text cut into sentences), ``utterance`` (units spoken in order) and
  ``alignment`` (estimated character and word times)
- ``zmq_protocol``, ``zmq_server``, ``zmq_client``: the ZeroMQ protocol, server, client
- ``metrics``: Prometheus metrics; ``static/index.html``: the playground page

The API is documented in docs/api.md.
"""
