#!/usr/bin/env bash
# Run HERE (a machine with PyPI), from anywhere: fetch the wheels the GPU machine lacks and lay
# them out in parts that one device call each can carry.
#
#   scripts/gpu/prepare_wheels.sh            # -> .whl/part-1 ... .whl/part-N (+ MANIFEST.json)
#
# The GPU machine (KINDS.md: nvidia-h100-x1) has CPython 3.12, torch 2.11.0+cu130 and no
# network. vLLM 0.25.1 pins torch==2.11.0; its wheel (~240 MiB) is split with `split -b`
# into chunks that travel over consecutive calls while the machine stays warm. The list of
# wheels and why each is there: scripts/gpu/wheels.txt. The whole recipe: docs/gpu.md.
#
# Environment: PYTHON (default: the repo's .venv python, else python3), PART_MIB (61),
# CHUNK_MIB (60), KEEP_DOWNLOADS=1 (reuse .whl/download from an earlier run).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LIST=scripts/gpu/wheels.txt
HELPER=scripts/gpu/wheels.py
WHL=.whl
DL=$WHL/download
STAGING=$WHL/staging
PART_MIB=${PART_MIB:-61}
CHUNK_MIB=${CHUNK_MIB:-60}
PYVER=3.12   # the device's python3 (KINDS.md: Python 3.12.3)
PLATFORMS=()
# pip matches manylinux_2_N exactly: name every N a wheel here may use (device: glibc >= 2.35).
for n in 17 24 26 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# .whl/ must never be committed: the repo's .gitignore has /.whl/; say so loudly if not.
if ! git check-ignore -q "$WHL/x" 2>/dev/null; then
  echo "ERROR: $WHL/ is not ignored by git; add /.whl/ to .gitignore or .git/info/exclude" >&2
  exit 1
fi

# Disk first: ~300 MiB of downloads, the same again as staged chunks and parts (hard links
# where possible), and the project wheel's build directory.
need_mib=1200
free_mib=$(df -Pm "$REPO" | awk 'NR==2 {print $4}')
echo "free disk at $REPO: ${free_mib} MiB (need about ${need_mib})"
if (( free_mib < need_mib )); then
  echo "ERROR: not enough free disk" >&2
  exit 1
fi

# The working tree travels with every call: a part plus the tree must stay under 64 MiB.
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
tree_mib=$(awk -v b="$tree_bytes" 'BEGIN {printf "%.2f", b / 1048576}')
echo "working tree that travels with each call: ${tree_mib} MiB"
if awk -v t="$tree_mib" -v p="$PART_MIB" 'BEGIN {exit !(t + p > 63.5)}'; then
  PART_MIB=$(awk -v t="$tree_mib" 'BEGIN {printf "%d", 63.5 - t}')
  CHUNK_MIB=$((PART_MIB - 1))
  echo "the tree is large: parts lowered to ${PART_MIB} MiB, chunks to ${CHUNK_MIB} MiB"
fi

mkdir -p "$DL"
if [[ "${KEEP_DOWNLOADS:-0}" != 1 ]]; then rm -f "$DL"/*.whl; fi

echo "== downloading (CPython $PYVER, manylinux x86_64, --no-deps, binary only)"
mapfile -t REQS < <("$PYTHON" "$HELPER" read-list "$LIST" | cut -f1)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" \
  -d "$DL" "${REQS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
# Each requirement must have produced exactly one wheel (two versions stop the install there).
missing=0
for req in "${REQS[@]}"; do
  name=${req%%[=<>!~]*}
  stem=$(echo "$name" | tr '[:upper:]' '[:lower:]' | tr -- '-.' '__')
  n=$(find "$DL" -maxdepth 1 -iname "${stem}-*.whl" | wc -l)
  if (( n != 1 )); then echo "ERROR: $req -> $n wheels in $DL" >&2; missing=1; fi
done
(( missing == 0 )) || exit 1

echo "== slimming vLLM: optional native modules that the H100 path never loads"
# FlashAttention 2 (Hopper runs FlashAttention 3; flash_attn_interface imports FA2 in a
# try), the MoE kernels (platforms/cuda.py imports them under suppress(ImportError); Llama
# is dense), the Rust front end (only with VLLM_RUST_FRONTEND_PATH) and DeepGEMM's builds
# for other CPythons, and the Blackwell-only (SM100) sparse attention sources that only the
# MiniMax-M3 model files import (3.8 MiB: with it, the parts no longer fit three calls).
# device_install.sh verify checks that FA3 still loads.
for w in "$DL"/vllm-*.whl; do
  "$PYTHON" "$HELPER" slim "$w" \
    --drop 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
    --drop 'vllm/_moe_C_stable_libtorch.abi3.so' \
    --drop 'vllm/vllm-rs' \
    --drop 'vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so' \
    --drop 'vllm/third_party/fmha_sm100/*'
done
for w in "$DL"/xgrammar-*.whl; do
  # Only the Python extension is loaded; the static library is for C++ builds against it.
  "$PYTHON" "$HELPER" slim "$w" --drop '*.a'
done

echo "== building this project's wheel (orpheus-serve, --no-deps)"
rm -f "$DL"/orpheus_serve-*.whl
had_build=0; [[ -e build ]] && had_build=1
had_egg=0; [[ -e orpheus_serve.egg-info ]] && had_egg=1
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DL" . 2>&1 \
  | grep -v "^WARNING: Location" | grep -iv "deprecat\|license\|^ *$\|^ *!!\|\*\*\*\|packaging.python.org\|corresp(" || true
(( had_build )) || rm -rf build   # setuptools' in-tree build dir, ignored but clutter
# ... and its egg-info, which would stand first on PYTHONPATH with this build's entry points
(( had_egg )) || rm -rf orpheus_serve.egg-info
ls "$DL"/orpheus_serve-*.whl >/dev/null

echo "== checking requirements: every carried wheel's needs are carried or on the device"
# The device's package list (KINDS.md, 'Python packages already there'), one name a line.
DEVLIST=$WHL/device_packages.txt
# The device tool's KINDS.md, next to the checkout (override with KINDS_MD=...).
KINDS=${KINDS_MD:-../.library/device/KINDS.md}
if [[ -r $KINDS ]]; then
  sed -n 's/.*Packages: //p' "$KINDS" | head -1 | sed 's/\.$//' | tr ',' '\n' \
    | sed 's/^ *//; /^$/d' >"$DEVLIST"
else
  cp scripts/gpu/device_packages.txt "$DEVLIST"
fi
# vllm's own metadata names ~70 packages, most for features this server does not use
# (scripts/gpu/wheels.txt says which and why); the project wheel lists its CPU-side deps.
"$PYTHON" "$HELPER" deps "$DL" --device-packages "$DEVLIST" --ignore vllm,orpheus-serve

echo "== splitting wheels over ${CHUNK_MIB} MiB (split -b ${CHUNK_MIB}m) and laying out parts"
rm -rf "$STAGING"
mkdir -p "$STAGING"
for f in "$DL"/*.whl; do
  b=$(basename "$f")
  size=$(stat -c %s "$f")
  if (( size > CHUNK_MIB * 1048576 )); then
    (cd "$STAGING" && split -b "${CHUNK_MIB}m" -d -a 2 "../download/$b" "$b.chunk-")
    echo "$(sha256sum "$f" | cut -d' ' -f1) $size" >"$STAGING/$b.full-sha256"
    echo "split $b ($((size / 1048576)) MiB) into $(ls "$STAGING/$b".chunk-* | wc -l) chunks"
  else
    ln "$f" "$STAGING/$b" 2>/dev/null || cp "$f" "$STAGING/$b"
  fi
done
"$PYTHON" "$HELPER" layout "$STAGING" "$WHL/parts.tmp" --part-mib "$PART_MIB" \
  --tree-mib "$tree_mib" --when-file "$LIST"
rm -rf "$WHL"/part-*
for d in "$WHL"/parts.tmp/part-*; do mv "$d" "$WHL/"; done
mv "$WHL/parts.tmp/MANIFEST.json" "$WHL/MANIFEST.json"
rmdir "$WHL/parts.tmp"

echo "== result"
du -sm "$WHL"/part-* | awk '{printf "%s %s MiB\n", $2, $1}'
nparts=$(ls -d "$WHL"/part-* | wc -l)
echo "$nparts parts: carry .whl/part-1 in the first device call, .whl/part-2 in the next ..."
echo "(docs/gpu.md has the calls). Never commit .whl/."
