"""The sentence audio cache's parts without a server: the key, an entry's bytes, the node's
directory (atomic writes, a torn entry, the byte bound under a flood, second sight, the
TTL, a key's purge) and what a request's headers let it do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from gateway.cache import entry
from gateway.cache.control import NO_CACHE, NO_STORE, USE, of_field, of_header, without_logging
from gateway.cache.keys import UnitKey, checkpoint_identity
from gateway.cache.node import ENTRY, SEEN, TMP_PREFIX, NodeCache, tenant_id
from shm.messages import SamplingOverrides

pytestmark = pytest.mark.timeout(60)

PCM = bytes(range(256)) * 100  # 25,600 bytes: 0.53 s


def _key(**changes: object) -> UnitKey:
    base = UnitKey("k1", "model@1", "snac", "tara", "", "Hello there.", SamplingOverrides())
    return msgspec.structs.replace(base, **changes)


def test_every_field_that_decides_the_audio_changes_the_key() -> None:
    base = _key()
    variants = [
        _key(tenant="k2"),
        _key(model="model@2"),
        _key(codec="snac@2"),
        _key(voice="leo"),
        _key(voice_version="custom:1:2"),
        _key(text="Hello there!"),
        _key(sampling=SamplingOverrides(seed=1)),
        _key(sampling=SamplingOverrides(temperature=0.7)),
        _key(sampling=SamplingOverrides(top_p=0.9)),
        _key(sampling=SamplingOverrides(top_k=5)),
        _key(sampling=SamplingOverrides(repetition_penalty=1.2)),
        _key(sampling=SamplingOverrides(max_tokens=70)),
    ]
    digests = {base.digest(), *(v.digest() for v in variants)}
    assert len(digests) == len(variants) + 1
    assert _key().digest() == base.digest()  # and the same fields give the same key


def test_a_checkpoint_directory_s_identity_follows_its_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"a" * 10)
    first = checkpoint_identity(str(tmp_path))
    assert checkpoint_identity(str(tmp_path)) == first
    w.write_bytes(b"b" * 11)
    assert checkpoint_identity(str(tmp_path)) != first
    assert checkpoint_identity("canopylabs/orpheus-3b-0.1-ft") == "canopylabs/orpheus-3b-0.1-ft"


def test_an_entry_is_served_only_whole_and_only_for_its_key() -> None:
    d = _key().digest()
    data = entry.encode(d, PCM, 1000.0)
    assert entry.decode(d, data, not_before=0.0) == PCM
    assert entry.decode(_key(text="x").digest(), data, not_before=0.0) is None  # another key
    assert entry.decode(d, data[:-2], not_before=0.0) is None  # torn
    assert entry.decode(d, data[: entry.HEADER_BYTES - 1], not_before=0.0) is None
    flipped = bytearray(data)
    flipped[-100] ^= 1
    assert entry.decode(d, bytes(flipped), not_before=0.0) is None  # damaged
    assert entry.decode(d, data, not_before=1001.0) is None  # expired


def test_a_unit_is_stored_on_its_second_sight_and_served_byte_identical(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, max_bytes=10 << 20, ttl_s=3600, admit_after=2)
    d = _key().digest()
    assert cache.get("k1", d) is None
    assert cache.sighted("k1", d) == 1
    assert not cache.put("k1", d, PCM)  # a one-off is not stored
    assert cache.get("k1", d) is None
    assert cache.sighted("k1", d) == 2
    assert cache.put("k1", d, PCM)
    assert cache.get("k1", d) == PCM
    assert cache.get("k2", d) is None  # another tenant's directory: no cross-key hit
    assert not (tmp_path / tenant_id("k1") / (d + SEEN)).exists()  # its sightings are done


def test_an_expired_entry_is_never_served(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, max_bytes=10 << 20, ttl_s=60, admit_after=1)
    d = _key().digest()
    assert cache.put("k1", d, PCM, now=time.time() - 120)
    assert cache.get("k1", d) is None
    assert not cache.path("k1", d).exists()


def test_a_torn_entry_under_its_name_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, max_bytes=10 << 20, ttl_s=3600, admit_after=1)
    d = _key().digest()
    assert cache.put("k1", d, PCM)
    path = cache.path("k1", d)
    path.write_bytes(path.read_bytes()[: entry.HEADER_BYTES + 1000])  # a disk that lied
    assert cache.get("k1", d) is None
    assert not path.exists()


_WRITER = """
import sys, time
from pathlib import Path
from gateway.cache import node

cache = node.NodeCache(Path(sys.argv[1]), max_bytes=1 << 30, ttl_s=3600, admit_after=1)
real_fsync = node.os.fsync

def stalled_fsync(fd):
    print("writing", flush=True)
    time.sleep(60)  # killed here: the entry's bytes are in its temporary file only

node.os.fsync = stalled_fsync
cache.put("k1", sys.argv[2], b"\\x01\\x02" * 50_000)
"""


def test_a_writer_killed_mid_write_leaves_no_entry_and_its_temp_file_is_swept(
    tmp_path: Path,
) -> None:
    d = _key().digest()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), d],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    cache = NodeCache(tmp_path, max_bytes=1 << 30, ttl_s=3600, admit_after=1)
    tenant_dir = tmp_path / tenant_id("k1")
    [tmp] = list(tenant_dir.iterdir())
    assert tmp.name.startswith(TMP_PREFIX) and tmp.stat().st_size > 0  # torn, beside its name
    assert cache.get("k1", d) is None
    cache.sweep(now=time.time() + 120)  # a temporary file a minute old: its writer died
    assert not tenant_dir.exists() or not list(tenant_dir.iterdir())


def test_a_flood_of_unique_units_stays_within_the_bound_and_evicts_the_least_used(
    tmp_path: Path,
) -> None:
    bound = 40 * len(PCM)
    cache = NodeCache(tmp_path, max_bytes=bound, ttl_s=3600, admit_after=1)
    greeting = _key(text="Welcome!").digest()
    cache.put("k1", greeting, PCM)
    peak = 0
    for i in range(400):
        d = _key(text=f"one-off {i}").digest()
        cache.put("k1", d, PCM)
        assert cache.get("k1", greeting) == PCM  # used all along: never the LRU victim
        on_disk = sum(f.stat().st_size for f in (tmp_path / tenant_id("k1")).iterdir())
        peak = max(peak, on_disk)
    # A sweep every sixteenth of the bound written: at most that sixteenth above it.
    assert peak <= bound + bound // 16 + len(PCM) + entry.HEADER_BYTES
    r = cache.sweep()
    assert r.bytes <= bound and r.entries < 40
    assert cache.get("k1", greeting) == PCM


def test_the_sightings_of_one_offs_are_bounded(tmp_path: Path, monkeypatch) -> None:
    from gateway.cache import node

    monkeypatch.setattr(node, "MAX_SIGHTINGS", 50)
    cache = NodeCache(tmp_path, max_bytes=1 << 30, ttl_s=3600, admit_after=2)
    for i in range(120):
        cache.sighted("k1", _key(text=f"one-off {i}").digest())
    cache.sweep()
    assert len(list((tmp_path / tenant_id("k1")).glob("*" + SEEN))) == 50


def test_a_key_s_purge_removes_its_entries_only(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, max_bytes=10 << 20, ttl_s=3600, admit_after=1)
    d = _key().digest()
    cache.put("k1", d, PCM)
    cache.put("k2", d, PCM)
    assert cache.purge("k1") == 1
    assert cache.get("k1", d) is None
    assert cache.get("k2", d) == PCM
    assert cache.purge("nobody") == 0
    assert not list(tmp_path.glob("*/*" + ENTRY + ".tmp"))


def test_what_a_request_lets_the_cache_do() -> None:
    assert of_header(None) == USE
    assert of_header("max-age=0") == USE
    assert of_header("no-cache") == NO_CACHE
    assert of_header("No-Store, max-age=0") == NO_STORE
    assert of_header("no-cache, no-store") == NO_STORE
    assert of_field(None) == USE and of_field("no-store") == NO_STORE
    with pytest.raises(ValueError):
        of_field("sometimes")
    assert not without_logging(USE).write and without_logging(USE).read
