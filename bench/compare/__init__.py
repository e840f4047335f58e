"""``orpheus-serve bench compare``: orpheus-serve side by side with the reference approach,
on the same machine, load and criteria (docs/benchmarks.md, "The baseline").

- ``cli``: the command; starts each server in turn and runs the levels or the capacity search
  on each.
- ``comparison``: the ratios it reports, level by level and capacity by capacity.
- ``baseline/``: the reference package's serving approach on the same HTTP contract.

The load levels, capacity search, clients and servers' starting are bench.load's.
"""
