"""Stand-ins the benchmarks and tests run against: none of them is served.

- ``tiny_model``: the tiny random-weight Orpheus-shaped Llama and SNAC writer
- ``synthetic_backend``: a synthetic llm_worker + codec_worker for gateway tests and
  ``bench gateway``
- ``reference_decoder``: Orpheus-TTS's own streaming decoder, reproduced for comparison
- ``local_server``: a free loopback port and waiting for ``GET /ready``
- ``http_client``: many streaming HTTP requests from one process (``bench gateway``)
- ``clips``: reference clips (WAV) for custom voices
- ``otlp_receiver``: an OTLP/HTTP traces receiver (the tracing test, ``bench gateway --tracing``)
"""
