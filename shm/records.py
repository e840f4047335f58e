"""Record kinds carried by the shared-memory rings, and the payloads they hold.

Every ring record carries ``(kind, stream_id, seq, payload)``. ``seq`` lets a consumer
detect loss, duplication and reordering:

- ``CODES`` (llm_worker -> codec_worker): payload is ``n * FRAME_CODES`` ``CODE_DTYPE``
  SNAC codes in Orpheus slot order (slot 0..6 of each frame, each already reduced to
  [0, CODEBOOK_SIZE)); ``seq`` is the stream's index of the first frame in the record.
- ``PCM`` (codec_worker -> gateway): payload is ``PCM_DTYPE`` mono samples at
  ``SAMPLE_RATE``, ``SAMPLES_PER_FRAME`` per frame; ``seq`` is the stream's chunk index
  (0, 1, 2, ...).
- ``END``: the stream finished; payload is a msgpack ``StreamEnd``; ``seq`` is the next
  sequence number the stream would have used (frames for codes, chunks for PCM).
- ``ERROR``: the stream failed; payload is a msgpack ``StreamError``; no record of the
  stream follows.
- ``RESET`` (llm_worker -> codec_worker, stream id 0, no payload): the first record a newly
  started llm worker writes to its engine's code ring. The worker before it died with its
  streams unfinished; the codec worker drops (and fails) the streams that came from that ring.
- ``START`` (llm_worker -> codec_worker, only when tracing is on): payload is a msgpack
  ``StreamStart``, the stream's trace context; written before the stream's first ``CODES``.
  The codec worker's spans of the stream continue that trace (``common.tracing``). An error raised in the llm_worker travels through the codec ring and
  the codec worker forwards it, so it reaches the gateway after the audio before it.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np

# The numbers both ends of a ring must agree on: defined here only (docs/orpheus.md explains them).
FRAME_CODES = 7
"""Codes per frame: one per Orpheus slot (and one audio token per code)."""
CODEBOOK_SIZE = 4096
"""Values a code takes: [0, CODEBOOK_SIZE)."""
CODE_DTYPE = np.dtype("<i2")
"""A ``CODES`` payload's element type."""
FRAME_BYTES = FRAME_CODES * CODE_DTYPE.itemsize
PCM_DTYPE = np.dtype("<i2")
"""A ``PCM`` payload's sample type (mono)."""
BYTES_PER_SAMPLE = PCM_DTYPE.itemsize
SAMPLES_PER_FRAME = 2048
SAMPLE_RATE = 24_000
GATEWAY_SHIFT = 48
STREAM_COUNTER_MASK = (1 << GATEWAY_SHIFT) - 1


class RecordKind(enum.IntEnum):
    CODES = 1
    PCM = 2
    END = 3
    ERROR = 4
    RESET = 5
    START = 6


class StreamEnd(msgspec.Struct, frozen=True):
    reason: str  # "stop" (end of speech), "length" (max_tokens), "cancelled", "repetition"
    frames: int
    tokens: int = 0
    invalid_tokens_prevented: int = 0


class StreamStart(msgspec.Struct, frozen=True):
    traceparent: str  # W3C trace context of the stream's llm worker span
    voice: str = ""


class StreamError(msgspec.Struct, frozen=True):
    code: str  # machine-readable: "bad_request", "worker_restarted", "backpressure", ...
    message: str
    status: int = 500  # HTTP status the gateway should answer with if nothing was sent yet
    retry_after_s: int | None = None  # set where retrying can help: the answer's Retry-After


record_encoder = msgspec.msgpack.Encoder()
"""Encodes the payload of an END (``StreamEnd``) or ERROR (``StreamError``) record."""
end_decoder = msgspec.msgpack.Decoder(StreamEnd)
error_decoder = msgspec.msgpack.Decoder(StreamError)
start_decoder = msgspec.msgpack.Decoder(StreamStart)


def make_stream_id(gateway_index: int, counter: int) -> int:
    """Stream ids are unique per instance; the high bits route PCM to the right gateway."""
    return (gateway_index << GATEWAY_SHIFT) | (counter & STREAM_COUNTER_MASK)


def gateway_of(stream_id: int) -> int:
    return stream_id >> GATEWAY_SHIFT
