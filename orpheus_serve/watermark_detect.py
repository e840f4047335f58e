"""``orpheus-serve watermark detect FILE...``: does each file carry the server's watermark?

Each file (any container and codec PyAV/FFmpeg reads) is decoded to 24 kHz mono and read by
the detector the codec worker marks with (PerTh's decoder, ``codec_worker.watermark``), here
in this process on ``--device``. One line per file: the verdict, the score (the detector's
confidence in [0, 1]; marked at 0.5 and above, as PerTh's own reading rounds), the length;
then, where the file carries a C2PA manifest (a long-form job's signed WAV or MP3,
``common.provenance``), whether it holds, who signed it and what it declares; with
``--trust-anchors PEM`` also whether its signer chains to them. ``--json`` prints one JSON
object per file instead.

Exit code: 0 every file is marked, 1 one or more is not, 2 one or more could not be read.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.provenance.reading import Provenance

MAX_SECONDS = 3600.0
"""The longest file read (one pass of the detector over it: ~1 GB of memory per hour)."""
THRESHOLD = 0.5
EXIT_UNMARKED = 1
EXIT_UNREADABLE = 2


def detect(
    paths: Sequence[str],
    device: str = "cpu",
    as_json: bool = False,
    trust_anchors: str | None = None,
) -> int:
    """``trust_anchors``: PEM text of the certificates a C2PA signer must chain to."""
    import msgspec
    import torch

    from codec_worker.watermark import load_watermark
    from common.provenance.reading import read_provenance
    from gateway.audio.decode import UnreadableAudio, decode_clip

    watermark = load_watermark("perth", torch.device(device))
    assert watermark is not None
    code = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                pcm, rate = decode_clip(f, MAX_SECONDS)
        except (OSError, UnreadableAudio) as e:
            _emit(as_json, path, {"error": str(e)}, f"{path}: unreadable: {e}")
            code = max(code, EXIT_UNREADABLE)
            continue
        score = watermark.score(torch.from_numpy(pcm))
        marked = score >= THRESHOLD
        seconds = len(pcm) / 24_000
        result: dict[str, object] = {
            "watermark": watermark.name, "score": round(score, 4), "marked": marked,
            "seconds": round(seconds, 3), "sample_rate": rate,
        }  # fmt: skip
        line = (
            f"{path}: {'marked' if marked else 'unmarked'} "
            f"({watermark.name} {score:.3f}, {seconds:.2f} s at {rate} Hz)"
        )
        provenance = read_provenance(path, trust_anchors=trust_anchors)
        if provenance.present:
            result["c2pa"] = msgspec.to_builtins(provenance)
            line += "\n  " + _c2pa_line(provenance, trust_anchors is not None)
        _emit(as_json, path, result, line)
        if not marked:
            code = max(code, EXIT_UNMARKED)
    return code


def _c2pa_line(p: Provenance, anchors_given: bool) -> str:
    holds = "valid" if p.valid else "INVALID"
    if anchors_given:
        holds += ", trusted" if p.trusted else ", NOT trusted"
    said = [f"signer {p.signer}", f"source {p.digital_source_type}", f"by {p.generator}"]
    errors = f"; errors: {'; '.join(p.errors)}" if p.errors else ""
    return f"C2PA manifest: {holds}; " + ", ".join(said) + errors


def _emit(as_json: bool, path: str, result: dict[str, object], line: str) -> None:
    print(json.dumps({"file": path, **result}) if as_json else line)
    sys.stdout.flush()
