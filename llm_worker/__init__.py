"""The llm worker process: one vLLM ``AsyncLLM`` turning text into SNAC code frames.

Process entry point: ``main`` (``llm_worker.main.run``: sockets, rings, the engine's start,
warm-up and ready). Modules, each with one job:

- ``service``: ``LLMService``, the streams' state machine and the per-step publisher
- ``output``: ``RingSink``, the only writer of the code ring
- ``engine``: ``GenerationEngine`` (owns ``AsyncLLM``; add, the one way in, which converts
  a prompt to the output head's ids; abort; the step hook)
- ``requests``, ``prompt``, ``text``: a request's plan, its prompt ids, its text pieces
- ``codes``, ``repetition``: tokens to frames for all streams at once; the repetition guard
- ``engine_plan``, ``sampling_setup``: the engine's plan (its model runner, its logits
  processors and their per-stream hooks, its output head)
- ``output_head``: which output head (the audio-only head or the checkpoint's)
- ``warmup``: the warm-up batch before ready (every batch size the sampler switches at)
- ``custom_voices``, ``lora``: zero-shot and LoRA voices
- ``model_info``: the model's voices
- ``metrics``, ``profiling``: Prometheus metrics (labelled by engine); the profiler hook
- ``vllm_ext/``: what vLLM loads by name into its own processes (the vLLM plugin, the audio
  head's model class, the logits processors, the CPU LoRA fix, the phase timers, the CPU heap
  trimmer, the memory probe) and the token ids they share with the worker; it imports nothing
  else of the worker
"""
