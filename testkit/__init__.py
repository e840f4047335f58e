"""The test kit: stand-ins the tests, the benchmarks and the demo run against; none of them
is served. A package of its own (not under tests/, which is no package, nor bench/): the demo
and ``orpheus-serve tiny-model`` import it without the test packages or the bench extra.

- ``tiny_model``: the tiny random-weight Orpheus-shaped Llama and SNAC writer
- ``synthetic_backend``: a synthetic llm_worker + codec_worker for gateway tests and
  ``bench gateway``
- ``reference_decoder``: Orpheus-TTS's own streaming decoder, reproduced for comparison
- ``local_server``: a free loopback port and waiting for ``GET /ready``
- ``http_client``: many streaming HTTP requests from one process (``bench gateway``)
- ``clips``: reference clips (WAV) for custom voices
- ``otlp_receiver``: an OTLP/HTTP traces receiver (the tracing test, ``bench gateway --tracing``)
"""
