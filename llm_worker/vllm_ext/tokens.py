"""Orpheus token ids (see docs/orpheus.md). The single source of these numbers in llm_worker."""

from __future__ import annotations

from shm.records import CODEBOOK_SIZE, FRAME_CODES

BOS = 128000
"""Llama-3 ``<|begin_of_text|>``; the tokenizer prepends it."""
END_OF_TEXT = 128009
"""Llama-3 ``<|eot_id|>``: ends the text part of the prompt."""
CUSTOM_TOKEN_BASE = 128256
"""``<custom_token_N>`` is id ``CUSTOM_TOKEN_BASE + N``."""
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
"""The model's stop token: generation ends here."""
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_AI = 128262
PAD = 128263

AUDIO_TOKEN_BASE = 128266
"""First audio token; slot ``s`` of a frame uses ids ``AUDIO_TOKEN_BASE + s*CODEBOOK_SIZE + code``
(frame and codebook sizes are the wire contract's, shm.records)."""
AUDIO_TOKEN_END = AUDIO_TOKEN_BASE + FRAME_CODES * CODEBOOK_SIZE
"""One past the last audio token id (156938)."""
VOCAB_SIZE = 156_940
"""The checkpoints' vocabulary: 128,256 Llama-3 ids and 28,684 ``<custom_token_N>``."""

PROMPT_PREFIX = (START_OF_HUMAN,)
PROMPT_SUFFIX = (END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH)
