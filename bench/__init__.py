"""Every benchmark of orpheus-serve, sorted by what it measures.

``orpheus-serve bench WHICH`` (orpheus_serve/cli.py) runs one; each prints a table and
writes JSON (docs/benchmarks.md) through ``lib/``: one writer, one header (the machine and
versions it ran on), one way to draw a table, one percentile, one plot set-up. Needs the
``bench`` extra (rich, matplotlib). No serving package imports this one (.importlinter); the
stand-ins the benchmarks run against (the tiny model, the synthetic backend, the reference
decoder) are the test kit's, ``testkit``.

- ``lib/``: what every benchmark shares (``lib.report``, ``lib.environment``, ``lib.stats``,
  ``lib.plot``);
- components, each alone: ``codec/`` (batched SNAC decode against the reference decoder,
  the watermark off and on, the decoded audio's error in dB), ``llm/`` (the repetition
  penalty and constraint in vLLM's sampler, token-to-frame mapping per step, custom voices;
  the engines stepped in lockstep they time), ``engine/`` (the vLLM engine alone: step time
  against streams, per variant and engine count), ``gateway/`` (the gateway's CPU per
  stream, flush to first byte per protocol, interactive TTFB beside long-form jobs, the cost
  of text normalisation; all but the last against the synthetic backend), ``ring`` (the
  shared-memory ring's wait: publish to wake, and the check when data is there);
- the whole server under load: ``load/`` (the load generator and capacity search),
  ``compare/`` (side by side with the reference approach, ``compare.baseline``),
  ``soak/`` (a bounded soak: hung streams and growth), ``overload/`` (closed-loop levels past
  capacity against two admission modes, and the fairness between API keys), ``cache/`` (the
  sentence audio cache: its policy on a voice-agent trace, and the real server with the cache
  used and bypassed).
"""
