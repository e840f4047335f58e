"""The llm worker's voices beyond the checkpoint's own (those are ``llm_worker.model_info``'s).

- ``custom``: ``custom.ZeroShotVoices``, zero-shot voices read from the state directory, each
  one's prompt prefix built once
- ``lora``: ``lora.LoraVoices``, fine-tuned voices served through vLLM's multi-LoRA, loaded from
  the configuration and at run time by the admin API
"""
