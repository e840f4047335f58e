"""The baseline: the approach of Orpheus-TTS's reference package (orpheus_tts), served
over the same HTTP contract as orpheus-serve so that one load generator drives both.

One process: a vLLM ``AsyncLLM`` and an aiohttp server. Each request iterates its own
vLLM output stream and runs the reference streaming decoder inline in the event loop:
after 28 audio tokens and then every 7, a separate SNAC call decodes the last 4 frames
and samples 2048..4095 are sent. See docs/benchmarks.md ("The baseline") for every
place where this implementation departs from the package, and why.

- ``engine``: the vLLM engine, prompt and sampling; ``constraint``: a random-weight model
  made to emit audio tokens in slot order, as a trained one does
- ``decoder``: the package's streaming decoder; ``server``: the HTTP face

Run: ``python -m bench.compare.baseline --model DIR --codec-model DIR/snac --device cpu --port P``.
"""
