"""PerTh's own detector on audio files: the watermark tests' oracle (run in .venv-perth).

    .venv-perth/bin/python scripts/perth_oracle/score.py FILE.wav...

Prints one JSON object: for each file, ``score`` (the mean of
``PerthImplicitWatermarker.get_watermark(audio, sr, round=False)``), ``rounded`` (the mean
with ``round=True``, the confidence perth's CLI prints) and the file's sample rate. The files
are read by soundfile at their own rate; get_watermark resamples them to 32 kHz itself.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import soundfile
from perth import PerthImplicitWatermarker


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    marker = PerthImplicitWatermarker(device="cpu")
    out = {}
    for path in paths:
        audio, rate = soundfile.read(path, dtype="float32", always_2d=True)
        mono = audio.mean(axis=1)
        raw = marker.get_watermark(mono, sample_rate=rate, round=False)
        rounded = marker.get_watermark(mono, sample_rate=rate)
        out[path] = {
            "score": float(np.mean(raw)), "rounded": float(np.mean(rounded)), "rate": rate,
        }  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
