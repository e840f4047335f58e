"""The llm worker's vLLM engine: how it is built, the running engine, and its warm-up.

The set-up, before the engine exists (each step depends on the one before):

- ``plan``: ``plan.plan_engine`` chooses the model runner, then the logits processors
  (``sampling_setup``: the sampling package wired into the worker, with the per-stream
  hooks), then the output head (``output_head``: the audio-only head or the checkpoint's,
  and the token ids it implies)
- ``args``: ``args.prepare_engine_args``, the engine's ``AsyncEngineArgs`` and KV sizing, after
  ``env``: the device check and the process environment vLLM reads; ``generation_config/``
  is the empty generation config the engine is given

The running engine:

- ``engine``: ``engine.GenerationEngine``, which owns the ``AsyncLLM`` (add, the one way
  in; abort; the step listener)
- ``step_hooks``: how the worker learns a step's outputs are delivered (stats on or off)
- ``info``: what the startup log says vLLM built
- ``warmup``: the warm-up batch before ready (every batch size the sampler switches at)
"""
