"""Load generation and capacity search (docs/benchmarks.md): ``orpheus-serve bench load``,
and the clients, levels and statistics the soak, the comparison and the overload bench use.

- ``cli``: ``orpheus-serve bench load`` (and the arguments the other load commands share).
- ``session``: load levels against one server; ``runner``: closed and open loops;
  ``schedule``: precomputed Poisson arrivals; ``clients``: HTTP and ZeroMQ speech clients;
  ``texts`` + ``corpus/``: the text mix; ``progress``: a live line per level.
- ``trace``/``playback``/``window``/``summary``: from arrival traces to TTFB, RTF, underruns,
  throughput and goodput over the stable window (percentiles: ``bench.lib.stats``).
- ``criteria``: the three pass criteria and the capacity each gives; ``search``:
  bracketing capacity search; ``recompute``: a stored result's capacities again.
- ``report``/``plot``: output (the machine's description: ``bench.lib.environment``).
- ``servers``: starting and stopping the servers under test (orpheus-serve, the baseline).
"""
