"""The floor every process stands on. It imports no process package (orchestrator,
gateway, llm_worker, codec_worker); below it are the durable state, ``store``, and the wire
contract, ``shm``.

- ``config``: the configuration package: ``ServeConfig``, the whole server's configuration,
  made of one module per section (``config.llm``, ``config.codec``, ``config.gateway``,
  ``config.jobs``, ``config.text``; and ``shm.config``, ``store.voices``)
- ``limits``: the sampling fields' limits, checked by the gateway and the llm worker alike
- ``voice_lookup``: which voice a name is (the model's, LoRA, custom) and the messages of
  its refusals, the same in the gateway and the llm worker
- ``cpu_plan``: which cores each process (and each engine) runs on when the model runs on CPU
- ``mps``: whether NVIDIA's Multi-Process Service is active for this process (several engines
  on one GPU overlap only under it)
- ``heap``: garbage-collector settings of the serving processes once warm, and the full
  collection on a clock that keeps cyclic garbage from waiting for hours
- ``memory_probe``: a process's memory sampled from inside it (smaps, glibc's heap, the
  collector's objects), when ``ORPHEUS_PROFILE_MEMORY`` names a directory (a measurement tool)
- ``host_heap``: glibc's heap from Python (its statistics; ``HeapBound``, trimming past
  a bound, at most once an interval), for the codec worker and vLLM's CPU processes
- ``profiling``: the workers' profiler hooks, armed by the environment, triggered by a file
- ``link``: a worker's line to the orchestrator (``WorkerReady``, heartbeats)
- ``zmq_recv``: receiving on an asyncio ZeroMQ socket without trusting one wakeup
- ``aio``: a timed wait on an asyncio event that never drops a cancellation
- ``languages``: language codes (ISO 639-1) as requests, voices and dictionaries name them
- ``sentences``: where sentences and clauses end, per language and script (both the gateway's
  and the llm worker's splitters)
- ``provenance``: the C2PA manifest signed into the whole files the server writes (a job's
  WAV or MP3), declaring them AI-generated, and its reading and verification
- ``tracing``: OpenTelemetry tracing, off unless the standard variables or the config key say
  so; the process's tracer and the W3C trace context that travels with a request
"""
