"""``orpheus-serve bench soak``: a bounded soak of a real server under a mix of client
behaviour, watching for hung streams and for growth (docs/benchmarks.md).

- ``cli``: the command; ``clients``: the users and their scenarios, the flood, the sampling
  loop; ``sampling``: one sample of the instance's processes and /dev/shm;
  ``results``: the streams, samples and report; ``report``: the report built, its table and
  PNG.
- ``growth``: the verdict on memory growth after the warm-up, per process;
  ``probe_growth``: what each process's memory probe saw inside it (``--profile-memory``).

The HTTP clients and output arguments are bench.load's.
"""
