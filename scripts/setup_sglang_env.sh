#!/usr/bin/env bash
# Create (once) or reuse SGLang's virtual environment and print its path (the last line of stdout).
# Like setup_env.sh: it lives in the user's cache, keyed by a hash of requirements-sglang.txt and
# the torch spec, so a fresh clone reuses it and a change of pins rebuilds it. The build takes
# minutes (~3 GB); its log goes to $VENV.log and, on failure, its tail to stderr.
#   MILES_ASYNC_SGLANG_VENV   where (default ~/.cache/miles-async/venv-sglang)
#   MILES_ASYNC_TORCH_SPEC    the torch to install first (default torch==2.13.0: the CPU build here)
#   MILES_ASYNC_SGLANG_FULL=1 install sglang with all its (CUDA) dependencies: for GPU machines
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MILES_ASYNC_CACHE:-$HOME/.cache/miles-async}"
VENV="${MILES_ASYNC_SGLANG_VENV:-$CACHE/venv-sglang}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${MILES_ASYNC_TORCH_SPEC:-torch==2.13.0}"
FULL="${MILES_ASYNC_SGLANG_FULL:-0}"
REQ="$ROOT/requirements-sglang.txt"

stamp="$(sha256sum "$REQ" | cut -c1-16)-${TORCH_SPEC}-full${FULL}"
if [ -f "$VENV/.miles-async-stamp" ] && [ "$(cat "$VENV/.miles-async-stamp")" = "$stamp" ]; then
  echo "$VENV"
  exit 0
fi
LOG="$VENV.log"
mkdir -p "$(dirname "$VENV")"
echo "[setup_sglang_env] building SGLang's environment in $VENV (once; several minutes; log: $LOG)" >&2
build() {
  set -euo pipefail
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --upgrade pip
  local sglang deps cons
  sglang="$(grep -E '^sglang[=<>]' "$REQ")"
  deps="$(mktemp)"; cons="$(mktemp)"
  grep -vE '^sglang[=<>]' "$REQ" > "$deps"
  if [ "$FULL" = "1" ]; then
    "$VENV/bin/pip" install "$sglang"
  else
    # torch first and pinned (also as a constraint), so nothing below pulls a multi-GB CUDA build.
    "$VENV/bin/pip" install "$TORCH_SPEC"
    echo "$TORCH_SPEC" > "$cons"
    "$VENV/bin/pip" install --no-deps "$sglang"
    "$VENV/bin/pip" install -r "$deps" -c "$cons"
  fi
  rm -f "$deps" "$cons"
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"
}
# Not "if ! (build)": errexit is ignored inside a condition, so a failed step would not stop the build.
set +e
(build) > "$LOG" 2>&1
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "[setup_sglang_env] FAILED; last lines of $LOG:" >&2
  grep -v "WARNING: Location" "$LOG" | tail -25 >&2
  exit 1
fi
echo "$stamp" > "$VENV/.miles-async-stamp"
echo "[setup_sglang_env] done: $(du -sh "$VENV" | cut -f1) in $VENV" >&2
echo "$VENV"
