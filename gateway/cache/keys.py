"""What decides a synthesis unit's audio, and the key digested from it.

A unit is what the gateway sends to the model as one stream (a request's text, or one
sentence of a streaming protocol), after the text plan (dictionaries, normalisation) has
made it the text the model reads. Its audio is decided by: the tenant (the API key, or the
anonymous key; one shared scope under ``cache.scope = "node"``), the model checkpoint and
the codec checkpoint (their identities: name, and for a local directory its files' sizes and
times, so that new weights under the same path are a new model), the voice and its version
(a custom voice's file or a LoRA voice's entry: re-made or deleted, its entries are never
served again), the final text and every sampling field (the seed included). Not in it: the
output format, rate and ``speed``, applied per request after the cache by the encoder (one
entry serves them all), and the language, which reaches the model only through the final
text (the llm worker takes no language).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

from shm.messages import SamplingOverrides

KEY_VERSION = 1
"""Bumped when what the PCM depends on changes in a way the fields below do not show."""

NODE_SCOPE = "\x00node"
"""The tenant of every entry under ``cache.scope = "node"`` (no API key can be this)."""

JOB_TENANT_PREFIX = "\x00job:"


def job_tenant(owner: str) -> str:
    """The tenant of a long-form job's units: its owner (``gateway.jobs.store.owner_of``, a
    digest of the key; a job keeps no key in clear). Apart from the key's interactive
    entries; a key's purge removes both."""
    return JOB_TENANT_PREFIX + owner


_WEIGHT_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".model", ".txt")


class UnitKey(msgspec.Struct, frozen=True, array_like=True):
    """Everything that decides one unit's PCM (see the module docstring)."""

    tenant: str
    model: str
    codec: str
    voice: str
    voice_version: str
    text: str
    sampling: SamplingOverrides
    version: int = KEY_VERSION

    def digest(self) -> str:
        """The key's name: 32 hex digits of BLAKE2b over its msgpack encoding."""
        return hashlib.blake2b(_encoder.encode(self), digest_size=16).hexdigest()


_encoder = msgspec.msgpack.Encoder()


def checkpoint_identity(name_or_path: str) -> str:
    """A checkpoint's identity: its name; for a local directory also the name, size and
    modification time of each of its weight and configuration files (read once, at the
    gateway's start: new weights mean a restart)."""
    path = Path(os.path.expanduser(name_or_path))
    if not path.is_dir():
        return name_or_path
    h = hashlib.blake2b(digest_size=8)
    for f in sorted(path.iterdir()):
        if f.suffix in _WEIGHT_SUFFIXES and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{name_or_path}@{h.hexdigest()}"
