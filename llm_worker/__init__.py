"""The llm worker process: one vLLM ``AsyncLLM`` turning text into SNAC code frames.

Process entry point: ``main`` (``llm_worker.main.run``: sockets, rings, the engine's start,
warm-up and ready). Modules, each with one job:

- ``service``: ``LLMService``, which wires the three rooms of a stream's life and runs the
  pump after each engine step: ``intake`` (``LlmSubmit``/``AppendText``/``Cancel`` in, each
  segment's request started), ``publisher`` (each step's frames out to the code ring, then
  the endings), ``lifecycle`` (the one owner of a stream's life: opened, segments live and
  ended, closed with exactly one END or ERROR); ``stream`` is the state they share and the
  engine as they see it
- ``output``: ``RingSink``, the only writer of the code ring
- ``engine/``: the vLLM engine, its set-up before it exists, and its warm-up
  (``engine.engine``: ``GenerationEngine``, the running engine; ``engine.plan``,
  ``engine.args``: how it is built; ``engine.warmup``: the batch before ready)
- ``requests``, ``prompt``, ``text``: a request's plan, its prompt ids, its text pieces
- ``codes``, ``repetition``: tokens to frames for all streams at once; the repetition guard
- ``voices/``: the voices beyond the checkpoint's own (``voices.custom``: zero-shot;
  ``voices.lora``: LoRA)
- ``model_info``: what the checkpoint says about itself (its voices, languages, emotion tags)
- ``metrics``, ``profiling``: Prometheus metrics (labelled by engine); the profiler hook
- ``vllm_ext/``: what vLLM loads by name into its own processes (the vLLM plugin, the audio
  head's model class, the logits processors, the CPU LoRA fix, the phase timers, the CPU heap
  trimmer, the memory probe) and the token ids they share with the worker; it imports nothing
  else of the worker
"""
