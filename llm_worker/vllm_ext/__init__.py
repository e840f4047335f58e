"""The code vLLM loads by name into its own processes (the engine core, its workers), besides
the llm worker's: what vLLM imports from a string, an entry point or a class it is handed.

- ``plugin``: the vllm.general_plugins entry point (pyproject.toml), loaded by vLLM in
  every process it starts: registers the audio head's model class, starts ``heap_trim``,
  installs ``vec_isa``;
  with ``ORPHEUS_PROFILE_PHASES`` set, loads ``phase_timers``, with
  ``ORPHEUS_PROFILE_MEMORY`` set, ``common.memory_probe``
- ``audio_head_model``: ``OrpheusAudioHeadForCausalLM``, the audio-only output head's model
  class (vLLM builds it from the architectures its hf_overrides name)
- ``sampling/``: the logits processors (tensor repetition penalty, audio-token constraint;
  handed to vLLM as classes) and the worker-side plan that chooses them
- ``lora_cpu``: the CPU multi-LoRA fix, vLLM's worker_extension_cls in its worker
- ``phase_timers``: the engine core's host time by phase (a measurement tool of ``bench
  engine``)
- ``heap_trim``: on CPU, the thread in each vLLM process that hands free heap memory back
  (the llm table's cpu_heap_trim_s, passed by the worker in ``ORPHEUS_SERVE_VLLM_HEAP_TRIM_S``)
- ``vec_isa``: TorchInductor's checks of the CPU's vector ISAs remembered per host (about
  17 s of every vLLM 0.25 CPU engine's start otherwise)
- ``token_space``, ``tokens``: Orpheus's token ids and the output head's rotation of them,
  which the model class and the processors share with the worker

It imports nothing of ``llm_worker`` outside this folder (.importlinter,
``vllm-ext-self-contained``): loading it in vLLM's processes never drags in the worker's
service, sockets or rings, and the worker reaches it only through these modules.
"""
