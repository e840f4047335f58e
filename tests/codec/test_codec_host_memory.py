"""The codec worker's bound on free heap memory (CPU decoding): trimmed at most once an
interval, and only when more than the bound is free."""

from __future__ import annotations

import pytest

from codec_worker.host_memory import HeapBound


def test_the_codec_heap_bound_trims_at_most_once_an_interval_and_only_past_keep() -> None:
    heap = HeapBound(keep_bytes=1 << 20, every_s=15.0)
    if not heap.active:
        pytest.skip("not glibc 2.33+")

    def free_16_mib() -> bytearray:
        # Freed below a block still held (glibc would trim a free top by itself): > keep.
        blocks = [bytearray(1 << 16) for _ in range(256)]
        pin = bytearray(1 << 16)
        del blocks
        return pin

    pin = free_16_mib()
    assert heap.free_bytes() > 1 << 20
    assert heap.after_batch(100.0) and heap.trims == 1
    pin2 = free_16_mib()
    assert not heap.after_batch(110.0)  # within the interval
    assert heap.after_batch(115.0) and heap.trims == 2
    assert not HeapBound(keep_bytes=1 << 40).after_batch(0.0)  # little free: no trim
    del pin, pin2


def test_an_idle_worker_trims_once_after_batches() -> None:
    heap = HeapBound(keep_bytes=1 << 20, every_s=15.0)
    if not heap.active:
        pytest.skip("not glibc 2.33+")
    blocks = [bytearray(1 << 16) for _ in range(256)]
    pin = bytearray(1 << 16)
    del blocks
    assert not heap.when_idle()  # no batch ran yet: nothing of ours to hand back
    heap._next = 1e18  # the interval has not passed: after_batch does not trim
    assert not heap.after_batch(0.0)
    assert heap.when_idle() and heap.trims == 1
    assert not heap.when_idle()  # once per idle spell
    del pin
