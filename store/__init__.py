"""The server's durable state: what outlives its processes, in the state directory
(``voices.VoicesConfig.state_dir``) that every gateway and the llm workers of a node share
(and nodes that share a volume). The processes import it; it imports none of them, and of
the wire contract below it (``shm``) only the code frame's constants and the decode guard.

- ``durable``: records in the state directory (locked changes, whole-file writes)
- ``voices``: the ``[voices]`` table; custom (zero-shot) voices on disk
- ``lora``: the LoRA voices loaded at run time (``lora.LoraRegistry``)
"""
