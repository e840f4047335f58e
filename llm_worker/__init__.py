"""The llm worker process: one vLLM ``AsyncLLM`` turning text into SNAC code frames.

Process entry point: ``main`` (``llm_worker.main.run``: sockets, rings, the engine's start,
warm-up and ready). Modules, each with one job:

- ``service``: ``LLMService``, the streams' state machine and the per-step publisher
- ``output``: ``RingSink``, the only writer of the code ring
- ``engine``: ``GenerationEngine`` (owns ``AsyncLLM``; add, abort, the step hook)
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
- ``heap_trim``: on CPU, the thread in each vLLM process that hands free heap memory back
  (started by ``vllm_plugin`` from the llm table's cpu_heap_trim_s)
- ``memory_probe``: each vLLM process's RSS, heap, malloc and object counts, sampled from
  inside, loaded by ``vllm_plugin`` only when ``ORPHEUS_PROFILE_MEMORY`` names a directory (a
  measurement tool of ``scripts/dev/worker_memory.py``)
"""
