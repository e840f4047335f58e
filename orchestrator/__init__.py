"""The top of the serving processes: configuration loading, supervision of the workers,
shared-memory ownership, fail-fast checks. The ``orpheus-serve`` command is ``orpheus_serve``.

- ``settings``: ``ServeConfig`` from the CPU profile, the TOML file, the environment, flags
- ``supervisor``: starts, watches and restarts the workers of one instance (the codec, one
  llm worker per engine, the gateways); owns its segments
- ``launcher``: how the supervisor starts a worker process (its own session), the seam tests
  replace
- ``mps``: the start-up line on CUDA saying whether MPS is active, and the warning when
  several engines run without it
- ``child``: every worker's entry point (``python -m orchestrator.child ROLE [INDEX]``)
- ``proctree``: a worker's whole process tree (vLLM's included), killed and cleaned up
- ``reclaim``: what the instance holds in /dev/shm, recorded while it runs, and taken back
  after the whole instance died (at the next start, or ``orpheus-serve cleanup``)
- ``failures``: permanent start-up failures, found before or at start and said in one line
- ``logs``: text or JSON log lines on stderr for every process
"""
