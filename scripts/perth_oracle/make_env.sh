#!/usr/bin/env bash
# Builds the environment of the watermark tests' oracle: resemble-perth's own detector
# (PerthImplicitWatermarker.get_watermark), which imports librosa and torchaudio.
#
#   scripts/perth_oracle/make_env.sh VENV TORCH_VENV [PYTHON]
#
# torchaudio has no build for the run-time set's torch (2.13.0) and breaks `import vllm`, so
# the oracle cannot live in .venv. It reuses the torch 2.11.0 of TORCH_VENV (.venv-vllm025,
# PyPI's build, ~5 GB: not downloaded twice) through a .pth file, and adds torchaudio 2.11.0
# (without dependencies: torch is there), librosa and resemble-perth 1.0.1.
# Idempotent: a finished environment is left as it is ($VENV/.installed).
set -euo pipefail
VENV=${1:?usage: make_env.sh VENV TORCH_VENV [PYTHON]}
TORCH_VENV=${2:?usage: make_env.sh VENV TORCH_VENV [PYTHON]}
PY=${3:-python3.11}
[[ -f $VENV/.installed ]] && exit 0
torch_site=$("$TORCH_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$torch_site" >"$site/torch-from-vllm025.pth"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --no-deps torchaudio==2.11.0
"${pip[@]}" install -q librosa resemble-perth==1.0.1
"$VENV/bin/python" - <<'PY'
import torch, torchaudio, librosa  # noqa: F401  (the check: all import)
from perth import PerthImplicitWatermarker
assert PerthImplicitWatermarker is not None
print(f"PerTh oracle on torch {torch.__version__}, torchaudio {torchaudio.__version__}: ok")
PY
touch "$VENV/.installed"
