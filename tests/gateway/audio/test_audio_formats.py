"""The audio formats are stated once (``gateway.audio.formats``): request validation accepts
exactly its codecs and rates, every codec has a content type, and a WAV header carries the
rate of the stream it starts (issue 32, part 6)."""

from __future__ import annotations

import struct

import msgspec
import pytest

from gateway.audio.encoders import ENCODER_FORMATS, WavEncoder, wav_header
from gateway.audio.formats import (
    CODECS,
    CONTENT_TYPES,
    G711,
    RAW,
    SAMPLE_RATES,
    OutputFormat,
    check_format,
    default_rate,
)
from gateway.audio.output import make_output
from gateway.schemas import FieldRules


def test_request_validation_takes_the_formats_literals() -> None:
    for codec in CODECS:
        assert msgspec.convert({"response_format": codec}, FieldRules).response_format == codec
    for rate in SAMPLE_RATES:
        assert msgspec.convert({"sample_rate": rate}, FieldRules).sample_rate == rate
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"response_format": "ogg"}, FieldRules)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sample_rate": 11025}, FieldRules)


def test_every_codec_has_a_content_type_and_an_encoder() -> None:
    assert set(CONTENT_TYPES) == set(CODECS)
    assert set(ENCODER_FORMATS) | G711 == set(CODECS)
    assert RAW == {c for c in CODECS if OutputFormat(c, default_rate(c)).bytes_per_second}
    for codec in CODECS:
        fmt = OutputFormat(codec, default_rate(codec))
        check_format(fmt)
        make_output(fmt).close()


def _wav_rate(data: bytes) -> int:
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    return struct.unpack_from("<I", data, 24)[0]


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_a_wav_header_says_the_rate_of_its_stream(rate: int) -> None:
    assert _wav_rate(WavEncoder(rate).finish()) == rate
    enc = make_output(OutputFormat("wav", rate))
    pcm = b"\x00\x01" * 4800
    assert _wav_rate(enc.encode(pcm) + enc.finish()) == rate


def test_the_24khz_wav_is_the_stream_of_before() -> None:
    """The header the OpenAI API always sent (sizes unknown while streaming), then the PCM."""
    pcm = b"\x02\x00" * 2400
    b = make_output(OutputFormat("wav"))
    assert b.encode(pcm) + b.finish() == wav_header() + pcm
