"""The gateway: HTTP (OpenAI-compatible), WebSocket and ZeroMQ front ends of orpheus-serve.

Process entry point: ``gateway.main.run``. Modules, each with one job:

- ``service``: admission, sessions, cluster state, watchdog, drain (shared by front ends)
- ``streams`` / ``pcm_pump``: PCM ring records routed into bounded per-stream buffers
- ``admission``, ``cluster``, ``upstream``: slots and queue; ClusterStatus; control PUSH
- ``schemas``, ``voices``, ``errors``: request validation, voice names, JSON errors
- ``encoders``, ``sse``: pcm/wav/mp3/opus/aac/flac streaming encoders; SSE events
- ``app``, ``speech_http``, ``websocket``: the aiohttp application and its handlers
- ``zmq_protocol``, ``zmq_server``, ``zmq_client``: the ZeroMQ protocol, server, client
- ``metrics``: Prometheus metrics; ``static/index.html``: the playground page
- ``synthetic_backend``, ``bench``, ``bench_client``: test/benchmark harness (not served)

The API is documented in docs/api.md.
"""
