#!/usr/bin/env bash
# Create (once) or reuse SGLang's virtual environment and print its path (the last line of stdout); see
# scripts/lib/engine_env.sh for where it lives and when it is rebuilt. The build takes minutes (~3 GB).
#   MILES_ASYNC_SGLANG_VENV   where (default ~/.cache/miles-async/venv-sglang)
#   MILES_ASYNC_TORCH_SPEC, MILES_ASYNC_TORCH_INDEX_URL: which torch, from where (scripts/lib/torch_install.sh)
#   MILES_ASYNC_SGLANG_FULL=1 install sglang with all its (CUDA) dependencies: for GPU machines
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/engine_env.sh
source "$ROOT/scripts/lib/engine_env.sh"
# shellcheck source=scripts/lib/torch_install.sh
source "$ROOT/scripts/lib/torch_install.sh"
FULL="${MILES_ASYNC_SGLANG_FULL:-0}"
REQ="$ROOT/requirements-sglang.txt"

engine_build() {
  local sglang deps cons
  sglang="$(grep -E '^sglang[=<>]' "$REQ")"
  deps="$(mktemp)"; cons="$(mktemp)"
  grep -vE '^sglang[=<>]' "$REQ" > "$deps"
  if [ "$FULL" = "1" ]; then
    "$VENV/bin/pip" install "$sglang"
  else
    # torch first and pinned (also as a constraint), so nothing below pulls a multi-GB CUDA build.
    torch_install "$VENV" setup_sglang_env
    echo "$TORCH_SPEC" > "$cons"
    "$VENV/bin/pip" install --no-deps "$sglang"
    "$VENV/bin/pip" install -r "$deps" -c "$cons"
  fi
  rm -f "$deps" "$cons"
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"
}

engine_env sglang "$REQ" "${TORCH_STAMP}-full${FULL}"
