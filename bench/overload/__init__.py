"""``orpheus-serve bench overload``: goodput past capacity, two admission modes side by side
(issue 43; docs/benchmarks.md, *Overload*).

- ``cli``: the command; starts each arm's server, runs the levels and the fairness scenario.
- ``classify``: a stream real-time or not, a level's numbers, refusal latency, the verdict.
- ``shares``: the fairness scenario's keys against their fair shares and solo rates (issue 60).
- ``timeline``: ``/metrics`` scraped during the run, the streams' lead over their players.
- ``cpu``: the server's CPU by part (gateway, codec, llm) and the bench's over each phase.
- ``report``/``plot``: tables, JSON, PNG.

The clients, levels, playback analysis and statistics are bench.load's.
"""
