"""Load generation, capacity search and the side-by-side baseline (docs/benchmarks.md).

- ``cli``: ``orpheus-serve bench load``; ``compare``: ``orpheus-serve bench compare``.
- ``runner``: closed and open loops; ``schedule``: precomputed Poisson arrivals;
  ``clients``: HTTP and ZeroMQ speech clients; ``texts`` + ``corpus/``: the text mix.
- ``trace``/``playback``/``window``/``summary``/``stats``: from arrival traces to TTFB,
  RTF, underruns, throughput and goodput over the stable window.
- ``search``: bracketing capacity search; ``report``/``plot``/``environment``: output.
- ``baseline/``: the reference package's serving approach on the same HTTP contract;
  ``servers``: starting and stopping the servers under test.
"""
