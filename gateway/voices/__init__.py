"""Voices: ``catalogue`` (the voice names a request is resolved against, before admission),
``languages`` (the languages of the checkpoint and of each voice: a request's default
language, and what the listings show), ``custom`` (voices made from a reference clip: their
state) and ``custom_routes`` (the voices API and the LoRA admin calls)."""
