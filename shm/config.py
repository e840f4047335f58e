"""Configuration of the shared-memory transport (the ``[shm]`` table of the TOML file)."""

from __future__ import annotations

import msgspec


class ShmConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    code_ring_bytes: int = 4 << 20
    pcm_ring_bytes: int = 64 << 20
    run_dir: str = "/tmp"
    """Directory under which the instance's ZeroMQ ipc:// sockets are created."""
    spin_us: int = 50
    """Consumer spins this long on an empty ring before it sleeps on the doorbell."""
    recheck_ms: int = 50
    """A sleeping consumer rechecks the ring at least this often (a lost doorbell costs this)."""
