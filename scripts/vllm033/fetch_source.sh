#!/usr/bin/env bash
# Fetches vLLM 0.33's Python source (the version `pip install vllm` gives on an H100 today)
# so that tests/llm/test_vllm_source_compat.py can check the project against it on a CPU machine.
#
#   scripts/vllm033/fetch_source.sh DEST [VERSION]
#
# The CUDA wheel cannot be installed here; it is downloaded (no deps, linux x86_64, cp312)
# into ${XDG_CACHE_HOME:-$HOME/.cache}/orpheus-serve/ and only vllm/**/*.py is extracted
# into DEST. Idempotent: a finished DEST ($DEST/.complete names the wheel) is left as it is,
# and a cached wheel is not downloaded again. Prints one line saying what it did.
set -euo pipefail
DEST=${1:?usage: fetch_source.sh DEST [VERSION]}
VERSION=${2:-0.33.0}
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/orpheus-serve"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x $PY ]] || PY=python3
start=$SECONDS

find_wheel() {
  local w
  for w in "$CACHE/vllm-$VERSION-"*.whl; do [[ -f $w ]] && { echo "$w"; return; }; done
  return 0
}

# Already extracted from this version: nothing to do.
if [[ -f $DEST/.complete ]] && grep -q "^vllm-$VERSION-" "$DEST/.complete"; then
  echo "vllm $VERSION source already in $DEST ($(head -n 1 "$DEST/.complete"))"
  exit 0
fi

# Never replace a directory this script did not make.
if [[ -e $DEST && ! -f $DEST/.complete ]] && [[ -n $(ls -A "$DEST" 2>/dev/null) ]]; then
  echo "$DEST exists and is not a source tree from this script: not replacing it" >&2
  exit 1
fi

mkdir -p "$CACHE"
whl=$(find_wheel)
fetched="cached"
if [[ -z $whl ]]; then
  # Into a private directory first, so that an interrupted download leaves no wheel behind.
  dl=$(mktemp -d "$CACHE/.download.XXXXXX")
  trap 'rm -rf "$dl"' EXIT
  "$PY" -m pip --disable-pip-version-check download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dl" "vllm==$VERSION" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
  for w in "$dl/vllm-$VERSION-"*.whl; do [[ -f $w ]] && mv "$w" "$CACHE/"; done
  rm -rf "$dl"
  trap - EXIT
  whl=$(find_wheel)
  [[ -n $whl ]] || { echo "no vllm-$VERSION wheel after pip download into $CACHE" >&2; exit 1; }
  fetched="downloaded"
fi

# Extract into a temporary sibling and rename, so an interrupted run never leaves a
# half-filled DEST that looks complete.
parent=$(dirname "$DEST")
mkdir -p "$parent"
tmp=$(mktemp -d "$parent/.vllm-src.XXXXXX")
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
if ! count=$("$PY" - "$whl" "$tmp" <<'PY'
import sys
import zipfile

whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as zf:
    names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    zf.extractall(out, members=names)
print(len(names))
PY
); then
  echo "$whl is not a readable wheel: removed, run again to download it anew" >&2
  rm -f "$whl"
  exit 1
fi
basename "$whl" >"$tmp/.complete"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
echo "vllm $VERSION: $fetched $(basename "$whl"), extracted $count .py files into $DEST in $((SECONDS - start))s"
