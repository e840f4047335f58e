"""Stand-ins the benchmarks and tests run against: none of them is served."""
