#!/usr/bin/env bash
# The H100 recipe, run THERE (the device machine) from the repo root, one device call per line
# of the 15-minute plan in docs/gpu.md. Every call is under 10 minutes; the machine must stay
# warm between calls (it goes back 30 s after a call: issue the next call at once).
#
#   call  carry         command (bash scripts/gpu/run_capacity.sh ...)   what
#   1     .whl/part-1   first .whl/part-1     install what is complete; facts + measured ceilings;
#                                             the 3B model on the GPU (no codec bench, no check)
#   2     .whl/part-2   part .whl/part-2      stage one part (+ install what became complete)
#   3     .whl/part-3   last .whl/part-3      install vLLM; verify imports + FlashAttention 3
#   4     -             engine full-head,audio-head 64,216,320,384   bench engine t(N), 1 engine,
#                                             engine-core CPU, GPU busy, per-phase host µs
#   5     -             engines audio-head 2 on   K = 2 engines at the same total N (128, 256,
#                                             384) under CUDA MPS (this recipe's own daemon)
#   6     -             confirm               the server with the best K (llm.engines, MPS when it
#                                             won): a warm-up level, then the levels the sweeps
#                                             predict; CONFIRM_HOP2=1: again with first_hop_frames=2
#   7     -             engines audio-head 2 off  optional: K = 2 without MPS (N = 256, 384)
#   8     -             overload              optional: learned admission (no hand-set limit) at twice
#                                             the predicted real-time load
#   9     -             soak                  optional, only with device time left: bench soak on
#                                             the best configuration (SOAK_S, capped by the call)
#   later               capacity VARIANT (search + profile), baseline, compare-both, penalties,
#                       engine kv-fp8,top-p-off 256,384
#
# Prefix each command with GIT_COMMIT=<sha> (the device's copy has no .git): it is written
# into every result JSON. Stages for reruns by hand: facts, model, codec, serve VARIANT,
# wait-ready, single, search VARIANT, profile, stop, penalties, status.
# Opt-in in call 1: CODEC_STREAMS="32 128" (the codec benchmark), MODEL_CHECK=1 (28 sampled
# tokens checked valid); in call 3: PREFLIGHT_ONLY="" (the whole preflight, not just imports).
# CUDA MPS (calls 5, 6, 7): the recipe starts its own control daemon (nvidia-cuda-mps-control -d,
# pipe and log directories under a temp dir) and stops it (echo quit | nvidia-cuda-mps-control)
# when the stage ends, when the call exits, and at the start of the next call if a killed call
# left one; without the binary it records that and runs without.
#
# Results: the files under $OUT come back after each call (at most 8, 16 MiB each); logs,
# nvidia-smi dmon samples, per-process CPU samples, py-spy and torch-profiler traces and
# their summaries are packed into $OUT/<call>_extra.tgz (split into .tgz.NN pieces when
# large). docs/gpu.md says where each goes in the repo.
set -uo pipefail   # no -e: a failing stage reports and the call still returns its results

T_START=$SECONDS
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
PY=${PYTHON:-python3}
GPU_HOME=${GPU_HOME:-/tmp/orpheus-gpu}
OUT=${OUT:-$GPU_HOME/out}
WORK=$GPU_HOME/call            # this call's secondary files, packed into $OUT at the end
LOGS=$GPU_HOME/logs
PROF=$GPU_HOME/profile
STATE=$GPU_HOME/state
CALL_LIMIT_S=${CALL_LIMIT_S:-575}  # the device kills a command at 600 s
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
# ~10 s of audio per utterance: 7 tokens a frame, 2048 samples a frame at 24 kHz.
TOKENS=${TOKENS:-$((7 * ((10 * 24000 + 2047) / 2048)))}   # 7 * ceil(117.19) = 826
LEVEL_S=${LEVEL_S:-20}          # seconds of measured arrivals per load level
GATEWAYS=${GATEWAYS:-4}
DEVICE=${DEVICE:-cuda}          # cpu only for a local smoke test of this script (docs/gpu.md)
CODEC_COMPILE=${CODEC_COMPILE:-$([[ $DEVICE == cuda ]] && echo true || echo false)}
TOOLS=scripts/gpu/gpu_tools.py
mkdir -p "$OUT" "$WORK" "$LOGS" "$PROF" "$STATE"
if [[ -z ${MODEL:-} ]]; then
  # tmpfs when it has room: writing and re-reading 6.6 GB there takes seconds.
  shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
  if [[ -n $shm_free ]] && (( shm_free >= 20 )); then MODEL=/dev/shm/gpu-orpheus-3b
  else MODEL=$GPU_HOME/model; fi
fi
[[ -f $GPU_HOME/env.sh ]] && source "$GPU_HOME/env.sh"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OS=("$PY" -m orpheus_serve.cli)

log() { printf '[%4ds] %s\n' "$((SECONDS - T_START))" "$*"; }
left() { echo $((CALL_LIMIT_S - (SECONDS - T_START))); }
# run_for MAX_S RESERVE_S CMD...: CMD under a timeout of at most MAX_S seconds that also
# leaves RESERVE_S seconds of this call for what follows (the device kills at 600 s).
run_for() {
  local max=$1 reserve=$2; shift 2
  local budget=$(( $(left) - reserve ))
  (( budget > max )) && budget=$max
  if (( budget < 15 )); then log "SKIPPED (no time left in this call): $*"; return 124; fi
  timeout -k 10 "$budget" "$@"
}
note() { echo "$*" | tee -a "$WORK/NOTES.txt"; }

# ----------------------------------------------------------------------------- stages

stage_receive() { bash scripts/gpu/device_install.sh receive "$@"; }

stage_install_partial() {
  bash scripts/gpu/device_install.sh install --partial && source "$GPU_HOME/env.sh"
}

stage_facts() {
  log "facts (GPU, versions, measured ceilings)"
  nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
  nvidia-smi -q -d CLOCK,POWER,PERFORMANCE >"$WORK/nvidia-smi-q.txt" 2>&1
  run_for 90 30 "$PY" "$TOOLS" facts --ceilings --json "$OUT/h100_facts.json" | tail -20
  cp "$OUT/h100_facts.json" "$STATE/facts.json" 2>/dev/null   # machine + versions, for stamp
}

stage_model() {
  if [[ -f $MODEL/RANDOM_WEIGHTS.txt && -f $MODEL/snac/pytorch_model.bin ]]; then
    log "model already at $MODEL"; return 0
  fi
  log "generating the Orpheus-3B random-weight model on the GPU into $MODEL"
  # --speaks-codes: valid audio codes without a sampling constraint, so that the V2 runner
  # (no custom processors on vLLM 0.25) can be measured too (make_random_orpheus.py).
  run_for 240 30 "$PY" scripts/gpu/make_random_orpheus.py "$MODEL" --device "$DEVICE" \
    ${MODEL_FLAGS:---speaks-codes} | tee "$WORK/make_model.json" | tail -25
  # The 28-token check (28/28 valid on the H100, 2026-11-23) is the CPU tests' job now
  # (tests/deploy/test_gpu_recipe.py): opt-in here with MODEL_CHECK=1.
  if [[ -n ${MODEL_CHECK:-} ]] && grep -q '"speaks_codes": true' "$MODEL/config.json" 2>/dev/null; then
    log "checking that the model emits valid codes unconstrained"
    run_for 90 30 "$PY" scripts/gpu/make_random_orpheus.py "$MODEL" --device "$DEVICE" --check \
      | tee "$WORK/check_codes.json" || note "the model does not emit valid codes unconstrained: V2 runs produce little audio"
  fi
}

stage_codec() {
  # CODEC_STREAMS unset: 32 and 128; set but empty: skipped (call 1 runs this stage only when
  # CODEC_STREAMS is set and not empty: the codec benchmark yields no figure the plan needs).
  local streams=${CODEC_STREAMS-32 128}
  if [[ -z ${streams// /} ]]; then log "codec benchmark skipped (CODEC_STREAMS is empty)"; return 0; fi
  log "codec benchmark on the $DEVICE (compiled decoder: $CODEC_COMPILE), streams: $streams"
  local compile=(); [[ $CODEC_COMPILE == true ]] && compile=(--compile)
  # One invocation per level, each with its own JSON: a level cut by the time limit loses only
  # itself (a single run writes its JSON at the end). Each pays the compile warm-up (~85 s on
  # the H100 the first time; the inductor cache makes the next ones faster).
  local n
  for n in $streams; do
    run_for "${CODEC_MAX_S:-200}" 20 "${OS[@]}" bench codec --device "$DEVICE" "${compile[@]}" \
      --model "$MODEL/snac" --streams "$n" --json "$OUT/h100_codec_$n.json" \
      2>&1 | tee -a "$WORK/codec_bench.log" | tail -8
  done
}

# Whether the configuration loader accepts the profiling variables in the environment
# (ORPHEUS_* variables are configuration overrides; see docs/gpu.md "Profiling hooks").
profile_env_ok() {
  "$PY" - <<'EOF' 2>/dev/null
import sys
from orchestrator.settings import ConfigError, load_config
try:
    load_config(None, {}, {"ORPHEUS_PROFILE_DIR": "/tmp/x", "ORPHEUS_PROFILE_SECONDS": "3"})
except ConfigError:
    sys.exit(1)
EOF
}

variant_flags() {
  case $1 in
    bf16) echo "--set llm.max_num_seqs=${MAX_SEQS:-512}" ;;
    # sampling paths (docs/performance.md "V1 or V2 on the GPU"): bf16 is llm.model_runner
    # auto (V2 on the GPU), bf16v1 the legacy runner with our tensor penalty and constraint
    bf16v1) echo "--set llm.model_runner=v1 --set llm.max_num_seqs=${MAX_SEQS:-512}" ;;
    bf16sync) echo "--set llm.async_scheduling=false --set llm.max_num_seqs=${MAX_SEQS:-512}" ;;
    fp8kv) echo "--set llm.kv_cache_dtype=fp8 --set llm.max_num_seqs=${MAX_SEQS:-1024}" ;;
    fp8w) echo "--set llm.quantization=fp8 --set llm.max_num_seqs=${MAX_SEQS:-512}" ;;
    fp8) echo "--set llm.kv_cache_dtype=fp8 --set llm.quantization=fp8 --set llm.max_num_seqs=${MAX_SEQS:-1024}" ;;
    # the first chunk of two frames instead of one (the confirmation's second half)
    bf16hop2) echo "--set codec.first_hop_frames=2 --set llm.max_num_seqs=${MAX_SEQS:-512}" ;;
    *) echo "unknown variant $1 (bf16|bf16v1|bf16sync|fp8kv|fp8w|fp8|bf16hop2)" >&2; return 1 ;;
  esac
}

server_pid() { [[ -f $STATE/server.pid ]] && cat "$STATE/server.pid"; }
server_alive() { local p; p=$(server_pid) && [[ -n $p ]] && kill -0 "$p" 2>/dev/null; }
is_ready() {
  "$PY" -c "import sys,urllib.request as u; sys.exit(0 if u.urlopen('$URL/ready', timeout=3).status == 200 else 1)" 2>/dev/null
}

# Stops the server this recipe started (its pid is in $STATE/server.pid), then any of that
# server's own descendants that outlived it: their ids are taken before the SIGTERM and
# each is checked against its start time, so no other process is ever signalled.
stage_stop() {
  local p
  p=$(server_pid) || true
  if [[ -n ${p:-} ]] && kill -0 "$p" 2>/dev/null; then
    log "stopping the server (pid $p, $(cat "$STATE/server.variant" 2>/dev/null))"
    "$PY" - "$p" >"$STATE/server.tree" <<'EOF'
import sys, psutil
root = psutil.Process(int(sys.argv[1]))
for c in root.children(recursive=True):
    try:
        print(c.pid, c.create_time())
    except psutil.Error:
        pass
EOF
    kill -TERM "$p"
    for _ in $(seq 1 60); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
    kill -0 "$p" 2>/dev/null && { log "still alive after 60 s: SIGKILL"; kill -KILL "$p"; }
  fi
  if [[ -s $STATE/server.tree ]]; then
    sleep 3
    "$PY" - "$STATE/server.tree" <<'EOF'
import sys, psutil
for line in open(sys.argv[1]):
    pid, created = line.split()
    try:
        q = psutil.Process(int(pid))
        if abs(q.create_time() - float(created)) < 0.01:
            q.kill()
            print(f"killed leftover worker {pid} of the stopped server")
    except psutil.Error:
        pass
EOF
  fi
  rm -f "$STATE/server.pid" "$STATE/server.variant" "$STATE/server.tree"
  sleep 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null \
    | sed 's/^/GPU memory in use after stop: /'
}

stage_serve() {
  local variant=$1
  local flags
  flags=$(variant_flags "$variant") || return 1
  # llm.engines (issue 30): K vLLM engines sharing the GPU; the variant name records it
  local engines=${ENGINES:-1}
  flags="$flags --set llm.engines=$engines"
  [[ $engines != 1 ]] && variant="$variant-k$engines"
  if server_alive && [[ $(cat "$STATE/server.variant" 2>/dev/null) == "$variant" ]]; then
    log "server ($variant) already running"; return 0
  fi
  stage_stop
  local envs=(VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)
  if profile_env_ok; then
    envs+=(ORPHEUS_PROFILE_DIR="$PROF" ORPHEUS_PROFILE_SECONDS="${PROFILE_S:-3}")
    rm -f "$PROF"/trigger "$PROF"/*.done
  else
    note "profiling hooks: the configuration loader rejects ORPHEUS_PROFILE_* in the environment; not set (docs/gpu.md)"
  fi
  log "starting the server: $variant ($flags) with codec.compile=$CODEC_COMPILE, $GATEWAYS gateways"
  # setsid: the server outlives this call (the device keeps a new session's processes).
  # shellcheck disable=SC2086
  setsid env "${envs[@]}" "${OS[@]}" serve --model "$MODEL" --codec-model "$MODEL/snac" \
    --device "$DEVICE" --port "$PORT" --set codec.compile="$CODEC_COMPILE" \
    --set gateway.admission="${ADMISSION:-fixed}" \
    --set gateway.max_active_streams=1024 --set gateway.max_queued_streams=1024 \
    --set gateway.processes="$GATEWAYS" $flags ${SERVE_EXTRA:-} \
    >"$LOGS/serve-$variant.log" 2>&1 </dev/null &
  echo $! >"$STATE/server.pid"
  echo "$variant" >"$STATE/server.variant"
  echo "$SECONDS" >"$STATE/server.t0"
  stage_wait_ready
}

stage_wait_ready() {
  local t0=$SECONDS
  while ! is_ready; do
    if ! server_alive; then
      log "the server exited before it was ready; log tail:"
      tail -40 "$LOGS/serve-$(cat "$STATE/server.variant" 2>/dev/null).log"
      return 1
    fi
    if (( $(left) < 30 )); then
      log "not ready yet after $((SECONDS - t0)) s; it keeps starting (next call: wait-ready)"
      return 2
    fi
    sleep 2
  done
  log "server ready after $((SECONDS - t0)) s of waiting"
  echo "$((SECONDS - t0))" >"$STATE/ready_wait_s"
  grep -iE "model weights took|KV cache|GPU KV|Maximum concurrency|graph capturing|compil" \
    "$LOGS/serve-$(cat "$STATE/server.variant").log" | tail -12
}

start_samplers() {
  local tag=$1
  nvidia-smi dmon -s pucm -d 1 -o T >"$WORK/dmon_$tag.txt" 2>&1 &
  echo $! >"$STATE/dmon.pid"
  "$PY" "$TOOLS" procs --out "$WORK/procs_$tag.jsonl" --interval 2 &
  echo $! >"$STATE/procs.pid"
}

stop_samplers() {
  local tag=$1
  for f in dmon procs; do
    [[ -f $STATE/$f.pid ]] && kill "$(cat "$STATE/$f.pid")" 2>/dev/null
    rm -f "$STATE/$f.pid"
  done
  [[ -f $WORK/procs_$tag.jsonl ]] && "$PY" "$TOOLS" procs-summary "$WORK/procs_$tag.jsonl" \
    | tee "$WORK/procs_${tag}_summary.json"
}

bench_load() { "${OS[@]}" bench load --url "$URL" --fixed-tokens "$TOKENS" --no-progress "$@"; }

stage_single() {
  local variant=${1:-$(cat "$STATE/server.variant" 2>/dev/null)}
  is_ready || { log "server not ready: single skipped"; return 1; }
  # Short utterances: TTFB does not depend on the output length, and 20 s then hold many.
  log "single stream ($variant): p50 TTFB"
  run_for 60 20 "${OS[@]}" bench load --url "$URL" \
    --fixed-tokens "${SINGLE_TOKENS:-140}" --no-progress --concurrency 1 --duration 20 \
    --warmup 3 --json "$OUT/h100_single_$variant.json" 2>&1 | tail -15
  [[ -s $OUT/h100_single_$variant.json ]] && touch "$STATE/single_$variant.done"
}

stage_search() {
  local variant=$1
  is_ready || { log "server not ready: search skipped"; return 1; }
  local start=${SEARCH_START:-64}
  if [[ $variant != bf16 && -z ${SEARCH_START:-} && -f $STATE/capacity_bf16 ]]; then
    start=$(cat "$STATE/capacity_bf16")   # FP8 should hold more: start at BF16's capacity
  fi
  # One search brackets the published, real-time and interactive capacities (bench load
  # --search), after a discarded warm-up level at the start (no start-up stall in a figure).
  local reserve=20 report=(--ttfb-report 0.5) res=${SEARCH_RES:-0.15}
  [[ $variant == bf16 ]] && res=${SEARCH_RES:-0.1}
  [[ $variant == bf16 || -n ${PROFILE:-} ]] && reserve=${RESERVE_AFTER_SEARCH:-80}
  log "capacity search ($variant) from $start, $LEVEL_S s levels, $TOKENS tokens per utterance"
  start_samplers "search_$variant"
  run_for 600 "$reserve" "${OS[@]}" bench load --url "$URL" \
    --fixed-tokens "$TOKENS" --no-progress --search --search-start "$start" \
    --search-max "${SEARCH_MAX:-1024}" --search-resolution "$res" "${report[@]}" \
    --warmup-level "$start" --warmup-level-duration "${WARMUP_LEVEL_S:-10}" \
    --duration "$LEVEL_S" --drain-timeout 30 \
    --json "$OUT/h100_capacity_$variant.json" --plot "$OUT/h100_capacity_$variant.png" \
    2>&1 | tee "$WORK/search_$variant.log" | tail -40
  stop_samplers "search_$variant"
  local cap
  if cap=$("$PY" "$TOOLS" capacity "$OUT/h100_capacity_$variant.json" --criterion real-time); then
    echo "$cap" >"$STATE/capacity_$variant"
    log "capacity ($variant, real-time): $cap streams; published: $("$PY" "$TOOLS" capacity \
      "$OUT/h100_capacity_$variant.json" --criterion published)"
  else
    log "no capacity in $OUT/h100_capacity_$variant.json (search cut short?)"
  fi
}

# Profile at the capacity limit: a closed-loop level at the found capacity; 20 s in, the
# torch-profiler hooks are triggered (when wired) and py-spy samples every server process.
stage_profile() {
  local variant
  variant=$(cat "$STATE/server.variant" 2>/dev/null) || { log "no server"; return 1; }
  local cap=${PROFILE_AT:-$(cat "$STATE/capacity_$variant" 2>/dev/null)}
  [[ -n $cap && $cap -gt 0 ]] || { log "no capacity known for $variant: profile skipped"; return 1; }
  (( $(left) > 75 )) || { log "too little time left: profile skipped"; return 1; }
  log "profiling at $cap streams ($variant)"
  start_samplers "profile_$variant"
  bench_load --concurrency "$cap" --duration 35 --drain-timeout 20 \
    --json "$WORK/profile_load_$variant.json" >"$WORK/profile_load_$variant.log" 2>&1 &
  local load=$!
  sleep 20
  echo "$variant-c$cap" >"$PROF/trigger"   # the armed workers start their captures
  local spy=() spybin
  spybin=$(command -v py-spy || echo "$(dirname "$(command -v "$PY")")/py-spy")
  if [[ -x $spybin ]]; then
    local pids
    # Only the processes of the server this recipe started (its descendants).
    pids=$("$PY" - "$(server_pid)" <<'EOF'
import psutil, sys
sys.path.insert(0, "scripts/gpu")
from gpu_tools import _role
for p in psutil.Process(int(sys.argv[1])).children(recursive=True):
    try:
        r = _role(" ".join(p.cmdline()))
    except psutil.Error:
        continue
    if r in ("engine_core", "mp_child", "llm_worker", "codec_worker", "gateway"):
        print(p.pid, r)
EOF
)
    while read -r pid role; do
      [[ -z $pid ]] && continue
      "$spybin" record --nonblocking --rate 200 --duration 10 --format speedscope \
        --output "$WORK/pyspy_${variant}_${role}_$pid.json" --pid "$pid" \
        >"$WORK/pyspy_${role}_$pid.log" 2>&1 &
      spy+=($!)
    done <<<"$pids"
  else
    note "py-spy not installed: no sampled Python profiles"
  fi
  for p in "${spy[@]}"; do wait "$p"; done
  # The hooks write <role>.done when their capture is on disk (docs/gpu.md).
  for _ in $(seq 1 30); do
    [[ $(ls "$PROF"/*.done 2>/dev/null | wc -l) -ge 2 ]] && break
    sleep 1
  done
  wait "$load"
  stop_samplers "profile_$variant"
  tail -12 "$WORK/profile_load_$variant.log"
  local traces
  traces=$(find "$PROF" -name '*.json*' -newer "$PROF/trigger" -type f 2>/dev/null)
  if [[ -n $traces ]]; then
    # shellcheck disable=SC2086
    "$PY" "$TOOLS" trace-summary $traces --steps "gpu_model_runner: forward|execute_model" \
      --json "$OUT/h100_profile_summary_$variant.json"
    mkdir -p "$GPU_HOME/traces_$variant"
    # shellcheck disable=SC2086
    cp $traces "$GPU_HOME/traces_$variant/"
    "$PY" "$TOOLS" pack "$GPU_HOME/traces_$variant" "$OUT" --name "h100_traces_$variant" \
      --max-mib 30
  else
    note "profiling hooks: no torch-profiler traces appeared under $PROF (see the .done files and the worker logs)"
  fi
  ls "$WORK"/pyspy_*.json >/dev/null 2>&1 && log "py-spy profiles: $(ls "$WORK"/pyspy_*.json | wc -l)"
}

# The engine alone (orpheus-serve bench engine): t(N) per variant, one vLLM start each, with
# the engine core's CPU and the GPU's busy fraction per level. No server may hold the GPU.
# Each level warms up for ENGINE_WARMUP steps (480) before its ENGINE_STEPS (300) measured
# ones: with the bench's staggered starts, the measured window's mean context is then 93 % of
# the steady state's (a whole generation of warm-up, 840 steps, would cost 46 % more time).
stage_engine() {
  local variants=${1:-full-head,audio-head}
  # ENGINE_STREAMS_FORCE: every sweep at these levels (the CPU rehearsal's tiny sizes)
  local streams=${ENGINE_STREAMS_FORCE:-${2:-${ENGINE_STREAMS:-64,96,128,160,192,224,256,320,384}}}
  local tag=${variants//,/_}
  local help
  if ! help=$("${OS[@]}" bench engine --help 2>&1); then
    log "ERROR: this tree has no \`orpheus-serve bench engine\`: engine sweep ($variants) not run"
    return 1
  fi
  local warm=()
  [[ $help == *--warmup-steps* ]] && warm=(--warmup-steps "${ENGINE_WARMUP:-480}")
  # The lever variants (top-p-off, kv-fp8, ...) on the head the server serves on a GPU
  [[ $help == *--lever-head* ]] && warm+=(--lever-head "${ENGINE_LEVER_HEAD:-audio}")
  stage_stop
  log "engine sweep: $variants, streams $streams, ${ENGINE_STEPS:-300} steps after ${warm[1]:-the default} warm-up steps"
  start_samplers "engine_$tag"
  # shellcheck disable=SC2086
  run_for 600 25 "${OS[@]}" bench engine --model "$MODEL" --device "$DEVICE" \
    --streams "$streams" --steps "${ENGINE_STEPS:-300}" --variants "$variants" "${warm[@]}" \
    ${ENGINE_EXTRA:-} --json "$OUT/h100_engine_$tag.json" --png "$OUT/h100_engine_$tag.png" \
    2>&1 | tee "$WORK/engine_$tag.log" | tail -30
  local rc=${PIPESTATUS[0]}
  stop_samplers "engine_$tag" >/dev/null
  if [[ ! -s $OUT/h100_engine_$tag.json ]]; then
    log "engine sweep ($variants) wrote no JSON (exit $rc)"; return 1
  fi
  cp "$OUT/h100_engine_$tag.json" "$STATE/engine_$tag.json"   # for the confirmation call
  "$PY" "$TOOLS" predict "$OUT/h100_engine_$tag.json" --json | sed 's/^/predicted capacities: /'
  return "$rc"
}

# ----------------------------------------------------------------------------- CUDA MPS
# Several engines' kernels overlap on one GPU only under MPS. The daemon is this recipe's own:
# its pipe and log directories live under a temp dir, and only processes started with
# CUDA_MPS_PIPE_DIRECTORY pointing there become its clients. Its directory is remembered in
# $STATE/mps_dir so that a call killed at its limit (no EXIT trap runs then) has its daemon
# stopped by the next call.

mps_start() {
  mps_stop   # a daemon a killed call left
  local bin
  if ! bin=$(command -v nvidia-cuda-mps-control); then
    note "MPS: nvidia-cuda-mps-control is not on this machine: the engines run without MPS"
    return 1
  fi
  local dir
  dir=$(mktemp -d /tmp/orpheus-mps.XXXXXX) || return 1
  mkdir -p "$dir/pipe" "$dir/log"
  echo "$dir" >"$STATE/mps_dir"
  if ! CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log "$bin" -d \
      >"$WORK/mps_start.txt" 2>&1; then
    note "MPS: nvidia-cuda-mps-control -d failed ($(tr '\n' ' ' <"$WORK/mps_start.txt")): running without MPS"
    mps_stop; return 1
  fi
  local _
  for _ in $(seq 1 50); do [[ -p $dir/pipe/control ]] && break; sleep 0.1; done
  if [[ ! -p $dir/pipe/control ]]; then
    note "MPS: the daemon made no control pipe in 5 s: running without MPS"; mps_stop; return 1
  fi
  export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
  trap 'mps_stop' EXIT
  trap 'mps_stop; exit 143' TERM INT
  log "MPS control daemon started (pipe $dir/pipe)"
}

mps_stop() {
  local dir
  dir=$(cat "$STATE/mps_dir" 2>/dev/null) || return 0
  [[ -n $dir ]] || { rm -f "$STATE/mps_dir"; return 0; }
  if [[ -p $dir/pipe/control ]] && command -v nvidia-cuda-mps-control >/dev/null; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$dir/pipe nvidia-cuda-mps-control >/dev/null 2>&1
    local _
    for _ in $(seq 1 100); do [[ -p $dir/pipe/control ]] || break; sleep 0.1; done
    log "MPS control daemon stopped"
  fi
  mkdir -p "$WORK/mps_log" && cp -r "$dir/log/." "$WORK/mps_log/" 2>/dev/null
  rm -rf "$dir" "$STATE/mps_dir"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# K engines of one variant at the same total N as call 4's single engine: MODES "on" (under
# this recipe's MPS daemon; where the binary is missing or the daemon does not start, the
# engines run without it and the JSON's "mps" says so), "off" (time-slicing), or "on,off".
# Call 4's audio-head levels are the K = 1 reference (same machine, warm-up and window).
stage_engines() {
  local variant=${1:-audio-head} counts=${2:-2} modes=${3:-on}
  local tag=${counts//,/_}
  local help
  if ! help=$("${OS[@]}" bench engine --help 2>&1) || [[ $help != *--engines* ]]; then
    log "ERROR: this tree's bench engine has no --engines: engines sweep not run"; return 1
  fi
  stage_stop
  local mode streams rc=0 flags
  for mode in ${modes//,/ }; do
    flags=()
    if [[ $mode == on ]]; then
      streams=${ENGINE_STREAMS_FORCE:-${ENGINES_STREAMS:-128,256,384}}
      if [[ $DEVICE == cuda ]] && mps_start; then flags=(--mps)
      else note "engines sweep (MPS on) runs without MPS (device $DEVICE)"; fi
    else
      streams=${ENGINE_STREAMS_FORCE:-${ENGINES_NOMPS_STREAMS:-256,384}}
    fi
    local name=h100_engines_${tag}_mps-$mode
    log "engines sweep: $variant, K=$counts, MPS $mode, streams $streams"
    start_samplers "engines_${tag}_mps-$mode"
    # shellcheck disable=SC2086
    run_for 600 25 "${OS[@]}" bench engine --model "$MODEL" --device "$DEVICE" \
      --streams "$streams" --engines "$counts" --steps "${ENGINE_STEPS:-300}" \
      --warmup-steps "${ENGINE_WARMUP:-480}" --variants "$variant" "${flags[@]}" \
      ${ENGINE_EXTRA:-} --json "$OUT/$name.json" --png "$OUT/$name.png" \
      2>&1 | tee "$WORK/$name.log" | tail -30
    (( PIPESTATUS[0] == 0 )) || rc=1
    stop_samplers "engines_${tag}_mps-$mode" >/dev/null
    mps_stop
    if [[ -s $OUT/$name.json ]]; then
      cp "$OUT/$name.json" "$STATE/engine_$name.json"   # for the confirmation's choice
    else
      log "engines sweep (MPS $mode) wrote no JSON"; rc=1
    fi
  done
  local all=("$STATE"/engine_*.json)
  [[ -f ${all[0]} ]] && "$PY" "$TOOLS" best-engines "${all[@]}" --json \
    | tee "$STATE/best_engines.json" | sed 's/^/best engines: /'
  return "$rc"
}

# The confirmation's engines and MPS: CONFIRM_ENGINES="K on|off", else the best of this
# session's sweeps (gpu_tools.py best-engines), else one engine.
confirm_engines() {
  if [[ -n ${CONFIRM_ENGINES:-} ]]; then echo "$CONFIRM_ENGINES"; return; fi
  local sweeps=("$STATE"/engine_*.json) best
  if [[ -f ${sweeps[0]} ]] && best=$("$PY" "$TOOLS" best-engines "${sweeps[@]}" 2>/dev/null); then
    read -r k mps _ <<<"$best"; echo "$k $mps"; return
  fi
  echo "1 off"
}

# The levels the confirmation runs: CONFIRM_LEVELS="PUBLISHED REAL_TIME", else what the
# engine sweeps of this session predict for K engines (MPS on|off), else the last H100
# figures (96 and 78).
confirm_levels() {
  local k=${1:-1} mps=${2:-off}
  if [[ -n ${CONFIRM_LEVELS:-} ]]; then echo "${CONFIRM_LEVELS//,/ }"; return; fi
  local sweeps=("$STATE"/engine_*.json)
  if [[ -f ${sweeps[0]} ]] && "$PY" "$TOOLS" predict "${sweeps[@]}" --engines "$k" \
      --mps "$mps" 2>/dev/null; then return; fi
  echo "96 78"
}

# One full-server confirmation of the sweep's prediction: a discarded warm-up level at the
# predicted published capacity, then the predicted real-time and published levels, with the
# three capacities computed over them (bench load). CONFIRM_HOP2=1: the same again with the
# first chunk of two frames (codec.first_hop_frames=2), when the call has time for it.
stage_confirm() {
  local variant=${1:-bf16} pub rt k mps
  read -r k mps <<<"$(confirm_engines)"
  read -r pub rt <<<"$(confirm_levels "$k" "$mps")"
  [[ -n $pub && -n $rt ]] || { log "no levels to confirm"; return 1; }
  log "confirmation ($variant, llm.engines=$k, MPS $mps): warm-up level c=$pub, then c=$rt and c=$pub"
  if [[ $mps == on ]] && ! mps_start; then mps=off; fi
  printf '{"engines": %s, "mps": %s, "published_predicted": %s, "real_time_predicted": %s}\n' \
    "$k" "$([[ $mps == on ]] && echo true || echo false)" "$pub" "$rt" >"$OUT/h100_confirm_setup.json"
  ENGINES=$k stage_serve "$variant" || return 1
  local levels=$rt
  [[ $pub != "$rt" ]] && levels="$rt,$pub"
  start_samplers "confirm_$variant"
  run_for 600 "${RESERVE_AFTER_CONFIRM:-20}" "${OS[@]}" bench load --url "$URL" \
    --fixed-tokens "$TOKENS" --no-progress --concurrency "$levels" \
    --warmup-level "$pub" --warmup-level-duration "${WARMUP_LEVEL_S:-10}" \
    --duration "$LEVEL_S" --drain-timeout 30 \
    --json "$OUT/h100_confirm_$variant.json" --plot "$OUT/h100_confirm_$variant.png" \
    2>&1 | tee "$WORK/confirm_$variant.log" | tail -14
  stop_samplers "confirm_$variant" >/dev/null
  [[ -s $OUT/h100_confirm_$variant.json ]]
}

# Learned admission at twice the load it holds (optional): the server with the confirmation's
# engines and MPS and no hand-set stream limit (gateway.admission=learned), a warm-up level at
# the predicted real-time capacity, then bench load at twice it: how many streams it admits,
# the share of them real-time, how the rest are answered (429s and their latency).
stage_overload() {
  local k mps pub rt
  read -r k mps <<<"$(confirm_engines)"
  read -r pub rt <<<"$(confirm_levels "$k" "$mps")"
  [[ -n $rt ]] || { log "no real-time level to double"; return 1; }
  if [[ $mps == on ]] && ! mps_start; then mps=off; fi
  log "overload: learned admission, llm.engines=$k, MPS $mps, c=$((2 * rt)) after c=$rt"
  ADMISSION=learned ENGINES=$k stage_serve bf16 || return 1
  start_samplers overload
  run_for 600 20 "${OS[@]}" bench load --url "$URL" --fixed-tokens "$TOKENS" --no-progress \
    --concurrency "$((2 * rt))" --warmup-level "$rt" \
    --warmup-level-duration "${WARMUP_LEVEL_S:-10}" --duration "$LEVEL_S" --drain-timeout 30 \
    --json "$OUT/h100_overload.json" --plot "$OUT/h100_overload.png" \
    2>&1 | tee "$WORK/overload.log" | tail -14
  stop_samplers overload >/dev/null
  [[ -s $OUT/h100_overload.json ]]
}

# The soak on the best configuration (optional, last): the server with the confirmation's
# engines and MPS, then bench soak for SOAK_S seconds (1200), cut to what the call has left.
stage_soak() {
  local k mps
  read -r k mps <<<"$(confirm_engines)"
  if [[ $mps == on ]] && ! mps_start; then mps=off; fi
  ENGINES=$k stage_serve bf16 || return 1
  local pid secs=${SOAK_S:-1200} room=$(( $(left) - 60 ))
  pid=$(server_pid)
  (( secs > room )) && secs=$room
  (( secs >= 10 )) || { log "soak skipped: $(left) s left in this call"; return 1; }
  log "soak: ${secs} s (asked ${SOAK_S:-1200}), llm.engines=$k, MPS $mps, ${SOAK_USERS:-64} users"
  start_samplers soak
  run_for 600 30 "${OS[@]}" bench soak --url "$URL" --pid "$pid" --device "$DEVICE" \
    --duration "$secs" --users "${SOAK_USERS:-64}" --interval "${SOAK_INTERVAL_S:-15}" \
    --json "$OUT/h100_soak.json" --plot "$OUT/h100_soak.png" 2>&1 \
    | tee "$WORK/soak.log" | tail -25
  stop_samplers soak >/dev/null
}

stage_baseline() {
  stage_stop
  log "baseline (the reference approach) on the same GPU: bench compare --only baseline"
  local args=(--model "$MODEL" --codec-model "$MODEL/snac" --device "$DEVICE" --only baseline
    --concurrency "${BASELINE_LEVELS:-1,24}" --search --search-start "${BASELINE_START:-16}"
    --duration "$LEVEL_S" --drain-timeout 30 --fixed-tokens "$TOKENS"
    --log-dir "$WORK/compare-logs" --no-progress
    --json "$OUT/h100_compare_baseline.json" --plot "$OUT/h100_compare_baseline.png")
  start_samplers baseline
  run_for 600 20 "${OS[@]}" bench compare "${args[@]}" 2>&1 | tee "$WORK/compare.log" | tail -40
  stop_samplers baseline
}

stage_compare_both() {
  stage_stop
  log "bench compare: baseline and orpheus-serve (BF16), alternating"
  run_for 600 20 "${OS[@]}" bench compare --model "$MODEL" --codec-model "$MODEL/snac" \
    --device "$DEVICE" --concurrency "${COMPARE_LEVELS:-24,64}" --duration "$LEVEL_S" \
    --drain-timeout 30 --fixed-tokens "$TOKENS" --log-dir "$WORK/compare-logs" --no-progress \
    --serve-arg=--set --serve-arg=codec.compile="$CODEC_COMPILE" \
    --serve-arg=--set --serve-arg=gateway.processes="$GATEWAYS" \
    --json "$OUT/h100_compare.json" --plot "$OUT/h100_compare.png" 2>&1 \
    | tee "$WORK/compare.log" | tail -40
}

stage_penalties() {
  if ! "$PY" -c "import bench.llm.penalties" 2>/dev/null; then
    note "bench.llm.penalties is not in this tree: penalties benchmark skipped"; return 0
  fi
  stage_stop
  local dev=()
  "${OS[@]}" bench penalties --help 2>/dev/null | grep -q -- "--device" && dev=(--device "$DEVICE")
  local model=()
  "${OS[@]}" bench penalties --help 2>/dev/null | grep -q -- "--model" && model=(--model "$MODEL")
  log "penalties benchmark on the GPU"
  run_for 600 20 "${OS[@]}" bench penalties "${dev[@]}" "${model[@]}" \
    --json "$OUT/h100_penalties.json" 2>&1 | tee "$WORK/penalties.log" | tail -30
}

stage_status() {
  bash scripts/gpu/device_install.sh status || true
  server_alive && log "server: $(cat "$STATE/server.variant") pid $(server_pid), ready: $(is_ready && echo yes || echo no)"
  for f in "$STATE"/capacity_*; do [[ -f $f ]] && log "$(basename "$f"): $(cat "$f")"; done
  command -v nvidia-smi >/dev/null \
    && nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
}

finish() {
  local tag=$1
  log "finishing $tag"
  # versions.git_commit where a result has none; machine and versions from call 1's facts
  # where a result carries none of its own
  "$PY" "$TOOLS" stamp "$OUT"/*.json --facts "$STATE/facts.json" 2>/dev/null
  for f in "$LOGS"/serve-*.log; do [[ -f $f ]] && tail -c 2000000 "$f" >"$WORK/$(basename "$f")"; done
  cp "$STATE"/* "$WORK/" 2>/dev/null
  [[ -f $WORK/NOTES.txt ]] && { echo "== notes"; cat "$WORK/NOTES.txt"; }
  "$PY" "$TOOLS" pack "$WORK" "$OUT" --name "${tag}_extra" --max-mib 25
  rm -rf "$WORK"; mkdir -p "$WORK"
  echo "== $tag: files under \$OUT"
  ls -la "$OUT" | tail -n +2
  stage_status
  log "call done ($((SECONDS - T_START)) s)"
}

# ----------------------------------------------------------------------------- calls

cmd=${1:-}; shift || true
# A call killed at its limit runs no EXIT trap: stop the MPS daemon it may have left, unless
# this call only reads the state.
[[ $cmd != status && -f $STATE/mps_dir ]] && mps_stop
case $cmd in
  first)   # call 1: carry .whl/part-1
    stage_receive "$@"; stage_install_partial
    stage_facts; stage_model
    [[ -n ${CODEC_STREAMS:-} ]] && stage_codec   # opt-in (docs/gpu.md)
    finish call1 ;;
  setup-stages)   # call 1 without the wheels (the CPU rehearsal on a shared machine)
    stage_facts; stage_model
    finish call1 ;;
  part)    # calls 2..N-1: carry .whl/part-K
    stage_receive "$@"; stage_install_partial
    finish "call_$(basename "${1:-part}")" ;;
  last)    # the call that carries the last part: install, verify; the server starts later
    stage_receive "$@"
    # verify: every import and FlashAttention 3; the rest of the preflight (sampling plan,
    # Sampler) is proven by the CPU rehearsal (PREFLIGHT_ONLY="" runs it all here too).
    if bash scripts/gpu/device_install.sh install && source "$GPU_HOME/env.sh" \
      && PREFLIGHT_ONLY=${PREFLIGHT_ONLY-imports} VERIFY_JSON="$OUT/h100_install.json" \
        bash scripts/gpu/device_install.sh verify; then
      stage_model
    else
      log "install or verify failed: see above (and $OUT/h100_install.json)"
    fi
    finish call_last ;;
  engine)  # call 4: the engine sweep of the variants named (comma list) [at these streams]
    stage_engine "${1:-full-head,audio-head}" "${2:-}"
    finish "call_engine_$(echo "${1:-full-head,audio-head}" | tr ',' '_')" ;;
  engines) # calls 5, 7: VARIANT, engine counts (comma list), MPS modes (on, off, on,off)
    stage_engines "${1:-audio-head}" "${2:-2}" "${3:-on}"
    finish "call_engines_$(echo "${2:-2}_${3:-on}" | tr ',' '_')" ;;
  confirm) # call 6: the server with the best K at the sweeps' predicted capacities
    stage_confirm bf16
    if [[ -n ${CONFIRM_HOP2:-} ]]; then
      if (( $(left) > ${HOP2_NEEDS_S:-240} )); then stage_confirm bf16hop2
      else log "first_hop_frames=2 skipped: $(left) s left in this call"; fi
    fi
    stage_stop
    mps_stop
    finish call_confirm ;;
  overload) # call 8 (optional): learned admission at twice the predicted real-time load
    stage_overload
    stage_stop
    mps_stop
    finish call_overload ;;
  soak)    # call 9 (optional): bench soak on the best configuration, as long as the call allows
    stage_soak
    stage_stop
    mps_stop
    finish call_soak ;;
  capacity)
    variant=${1:-bf16}
    if stage_serve "$variant"; then
      [[ -f $STATE/single_$variant.done ]] || stage_single "$variant"
      stage_search "$variant"
    fi
    if [[ $variant == bf16 || -n ${PROFILE:-} ]]; then stage_profile; fi
    finish "call_capacity_$variant" ;;
  baseline) stage_baseline; finish call_baseline ;;
  compare-both) stage_compare_both; finish call_compare ;;
  penalties) stage_penalties; finish call_penalties ;;
  # single stages (reruns by hand)
  facts) stage_facts; finish facts ;;
  model) stage_model; finish model ;;
  codec) stage_codec; finish codec ;;
  serve) stage_serve "${1:-bf16}"; finish "serve_${1:-bf16}" ;;
  wait-ready) stage_wait_ready; finish wait_ready ;;
  single) stage_single "$@"; finish single ;;
  search) stage_search "${1:-bf16}"; finish "search_${1:-bf16}" ;;
  profile) stage_profile; finish profile ;;
  stop) stage_stop; mps_stop; finish stop ;;
  status) stage_status ;;
  *) sed -n '2,28p' "$0"; exit 2 ;;
esac
