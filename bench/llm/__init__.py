"""The llm worker's pieces timed in-process (the whole engine alone: ``bench.engine``).

- ``penalties``: ``orpheus-serve bench penalties``: the repetition penalty and the audio-token
  constraint in vLLM's sampler, step time per variant;
- ``codes``: ``orpheus-serve bench codes``: token-to-frame mapping per engine step;
- ``voices``: ``orpheus-serve bench voices``: custom voices (LoRA adapters) stepped beside the
  base model, and the first request's time to first byte through a server;
- ``lockstep``: the in-process engines stepped in lockstep that ``penalties`` and ``voices``
  time.
"""
