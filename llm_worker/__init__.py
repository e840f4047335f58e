"""The llm worker process: one vLLM ``AsyncLLM`` turning text into SNAC code frames.

Process entry point: ``main`` (``llm_worker.main.run``: sockets, rings, the engine's start,
warm-up and ready). Modules, each with one job:

- ``service``: ``LLMService``, the streams' state machine and the per-step publisher
- ``output``: ``RingSink``, the only writer of the code ring
- ``engine``: ``GenerationEngine`` (owns ``AsyncLLM``; add, the one way in, which converts
  a prompt to the output head's ids; abort; the step hook)
- ``engine_plan``: the engine's plan (its model runner, its logits processors and their
  per-stream hooks, its output head)
- ``requests``, ``prompt``, ``text``: a request's plan, its prompt ids, its text pieces
- ``codes``, ``repetition``: tokens to frames for all streams at once; the repetition guard
- ``sampling/``, ``sampling_setup``: the model runner, penalty and constraint processors
- ``output_head``, ``audio_head_model``, ``vllm_plugin``: the audio-only output head (which
  head, its model class, the plugin that registers it with vLLM in every vLLM process)
- ``warmup``: the warm-up batch before ready (every batch size the sampler switches at)
- ``custom_voices``, ``lora``, ``lora_cpu``: zero-shot and LoRA voices
- ``model_info``, ``tokens``: the model's voices and Orpheus's token ids
- ``metrics``, ``profiling``: Prometheus metrics (labelled by engine); the profiler hook
- ``phase_timers``: the engine core's host time by phase, loaded by ``vllm_plugin`` into
  vLLM's processes only when ``ORPHEUS_PROFILE_PHASES`` names a directory (a measurement
  tool of ``bench engine``)
"""
