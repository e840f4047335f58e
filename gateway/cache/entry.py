"""One cache entry's bytes: a fixed header, then the unit's PCM (24 kHz, 16-bit mono).

The header holds a magic, the format's version, the key's digest (an entry answers only its
own key, whatever its file is called), when it was made, the PCM's length and a BLAKE2b
checksum of the PCM. ``decode`` returns None for anything that is not a whole entry of its
key (a short file, a torn write, flipped bits, another key's entry): such an entry is a
miss, never audio.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"ORPCACHE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sH16sdQ16s")
HEADER_BYTES = _HEADER.size
"""magic, version, key digest (16 bytes), made at (Unix time), PCM bytes, PCM checksum."""


def checksum(pcm: bytes | memoryview) -> bytes:
    return hashlib.blake2b(pcm, digest_size=16).digest()


def encode(digest: str, pcm: bytes, made_at: float) -> bytes:
    """The entry of key ``digest`` (hex) holding ``pcm``, made at ``made_at``."""
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, bytes.fromhex(digest), made_at, len(pcm), checksum(pcm)
    )
    return header + pcm


def decode(digest: str, data: bytes, *, not_before: float) -> bytes | None:
    """The PCM of an entry of key ``digest`` made at ``not_before`` or later; None if ``data``
    is not such a whole entry (torn, damaged, another key's, expired)."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, key, made_at, n, check = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or key != bytes.fromhex(digest):
        return None
    if made_at < not_before or len(data) != HEADER_BYTES + n or n & 1:
        return None
    pcm = memoryview(data)[HEADER_BYTES:]
    if checksum(pcm) != check:
        return None
    return bytes(pcm)
