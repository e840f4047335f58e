"""Load generation, capacity search and the side-by-side baseline (docs/benchmarks.md).

- ``cli``: ``orpheus-serve bench load``; ``compare``: ``orpheus-serve bench compare``
  (``comparison``: the ratios it reports); ``soak``: ``orpheus-serve bench soak`` (``growth``:
  its verdict on memory growth after the warm-up, per process; ``probe_growth``: what each
  process's memory probe saw inside it, with ``--profile-memory``).
- ``session``: load levels against one server; ``runner``: closed and open loops;
  ``schedule``: precomputed Poisson arrivals; ``clients``: HTTP and ZeroMQ speech clients;
  ``texts`` + ``corpus/``: the text mix; ``progress``: a live line per level.
- ``trace``/``playback``/``window``/``summary``: from arrival traces to TTFB, RTF, underruns,
  throughput and goodput over the stable window (percentiles: ``bench.lib.stats``).
- ``criteria``: the three pass criteria and the capacity each gives; ``search``:
  bracketing capacity search; ``recompute``: a stored result's capacities again.
- ``report``/``plot``: output (the machine's description: ``bench.lib.environment``).
- ``baseline/``: the reference package's serving approach on the same HTTP contract;
  ``servers``: starting and stopping the servers under test.
"""
