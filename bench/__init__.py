"""Every benchmark of orpheus-serve (the stand-ins they run against are the test kit's,
``testkit``).

``orpheus-serve bench WHICH`` (orpheus_serve/cli.py) runs one; each prints a table and
writes JSON (docs/benchmarks.md) through ``lib/``: one writer, one header (the machine
and versions of ``lib.environment``), one way to draw a table (``lib.report``), one
percentile (``lib.stats``), one plot set-up (``lib.plot``). Needs the ``bench`` extra
(rich, matplotlib). No serving package imports this one (.importlinter).

- components: ``codec`` (batched SNAC decode vs the reference decoder; ``codec_watermark``:
  its --watermark-ab, the watermark off and on), ``penalties`` (the
  repetition penalty and constraint in vLLM's sampler), ``codes`` (token-to-frame mapping
  per engine step), ``gateway`` (the gateway's CPU per stream against a synthetic backend),
  ``protocols`` (flush to first byte per streaming protocol), ``voices`` (custom voices),
  ``engine`` (the vLLM engine alone: step time against streams, per variant), ``jobs``
  (interactive TTFB with long-form jobs running and without), ``textnorm`` (the cost of
  text normalisation and pronunciation dictionaries per sentence), ``ring`` (the shared-memory
  ring's wait: publish to wake, and the check when data is there); ``quality.py``: the
  decoded audio's error against a reference, in dB (the codec bench and tests);
  ``lockstep.py``: the in-process engines stepped in lockstep that ``penalties`` and
  ``voices`` time; ``synthetic_gateway.py``: a gateway process as served in front of the
  synthetic backend, what ``gateway``, ``jobs`` and ``protocols`` measure;
- ``load/``: the end-to-end load generator and capacity search; ``compare/``: the
  side-by-side comparison with the reference approach (``compare.baseline``); ``soak/``: a
  bounded soak of a real server, hung streams and growth;
- ``overload/``: closed-loop levels past capacity against two admission modes, and the
  fairness between two API keys (issue 43), on ``load/``'s clients and statistics;
- ``cache/``: the sentence audio cache: its admission and eviction policy on a voice-agent
  trace (``cache/policy.py``: LRU, second sight, TinyLFU), and the real server on such a
  trace with the cache used and bypassed (``cache/trace.py``);
- the stand-ins (the tiny model, the synthetic backend, the reference decoder, a local
  server starter, the HTTP streaming client, reference clips) are the test kit's:
  ``testkit``.
"""
