"""RingSink on real shared-memory rings: order, backpressure, a stalled gateway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from codec_worker.output import RingSink
from shm.layout import InstanceLayout
from shm.records import RecordKind
from shm.ring import RingReader, RingWriter, create_ring


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rings(layout: InstanceLayout) -> Iterator[tuple[list[RingWriter], list[RingReader]]]:
    layout = InstanceLayout(layout.instance, layout.run_dir, gateways=2)
    for i in range(2):
        create_ring(layout.pcm_ring(i), 8192)
    readers = [RingReader(layout.pcm_ring(i)) for i in range(2)]
    writers = [RingWriter(layout.pcm_ring(i)) for i in range(2)]
    yield writers, readers
    for x in (*writers, *readers):
        x.close()


def drain(reader: RingReader) -> list[tuple[int, int, int, bytes]]:
    out = [(r.kind, r.stream_id, r.seq, bytes(r.payload)) for r in reader.poll()]
    reader.release()
    return out


def test_records_arrive_in_order_once_flushed(
    rings: tuple[list[RingWriter], list[RingReader]],
) -> None:
    writers, readers = rings
    sink = RingSink(writers, stall_timeout_s=1.0)
    for seq in range(3):
        sink.put(1, RecordKind.PCM, 7, seq, bytes([seq]) * 100)
    assert drain(readers[1]) == []  # staged, not yet published
    assert sink.flush(0.0) == []
    assert [(k, s, q) for k, s, q, _ in drain(readers[1])] == [
        (RecordKind.PCM, 7, q) for q in range(3)
    ]


def test_a_stalled_gateway_fails_its_streams_and_spares_the_others(
    rings: tuple[list[RingWriter], list[RingReader]],
) -> None:
    writers, readers = rings
    clock = Clock()
    sink = RingSink(writers, stall_timeout_s=2.0, clock=clock)
    chunk = b"\x01\x00" * 1000  # 2 KB: the 8 KB ring holds three
    sink.put(0, RecordKind.END, 5, 0, b"end-of-5")  # a finished stream
    for seq in range(6):
        sink.put(0, RecordKind.PCM, 1, seq, chunk)
    sink.put(0, RecordKind.PCM, 2, 0, chunk)
    assert sink.queued(0) > 0
    assert sink.flush(clock.t) == []
    assert sink.occupancy()[0] == 1.0
    # Gateway 1 is served while gateway 0's ring stays full.
    clock.t = 1.0
    sink.put(1, RecordKind.PCM, 9, 0, chunk)
    assert sink.flush(clock.t) == []
    assert [r[1] for r in drain(readers[1])] == [9]
    clock.t = 3.5
    assert sink.flush(clock.t) == [1, 2]  # still full past the timeout: audio streams fail
    sink.put(0, RecordKind.ERROR, 1, 0, b"error-1")
    # Once the gateway reads again, what stays queued (END, ERROR) arrives in order.
    got = drain(readers[0])
    sink.flush(clock.t)
    got += drain(readers[0])
    assert [(k, s) for k, s, _, _ in got][:1] == [(RecordKind.END, 5)]
    assert (RecordKind.ERROR, 1) in [(k, s) for k, s, _, _ in got]
    assert sink.queued(0) == 0
