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
- ``engine``: ``GenerationEngine``, the running engine (owns ``AsyncLLM``; add, the one way
  in, which converts a prompt to the output head's ids; abort; the step listener)
- ``step_hooks``: how the worker learns a step's outputs are delivered (stats on or off)
- ``requests``, ``prompt``, ``text``: a request's plan, its prompt ids, its text pieces
- ``codes``, ``repetition``: tokens to frames for all streams at once; the repetition guard
- the engine's set-up, before it exists: ``engine_plan``, ``sampling_setup``,
  ``output_head`` (its model runner, its logits processors and their per-stream hooks,
  which output head: the audio-only head or the checkpoint's), then ``engine_args`` (its
  ``AsyncEngineArgs`` and KV sizing, after ``engine_env``: the device check and the
  environment vLLM reads)
- ``engine_info``: what the startup log says vLLM built
- ``warmup``: the warm-up batch before ready (every batch size the sampler switches at)
- ``custom_voices``, ``lora``: zero-shot and LoRA voices
- ``model_info``: the model's voices
- ``metrics``, ``profiling``: Prometheus metrics (labelled by engine); the profiler hook
- ``vllm_ext/``: what vLLM loads by name into its own processes (the vLLM plugin, the audio
  head's model class, the logits processors, the CPU LoRA fix, the phase timers, the CPU heap
  trimmer, the memory probe) and the token ids they share with the worker; it imports nothing
  else of the worker
"""
