#!/usr/bin/env bash
# Create (once) or reuse the TRL peer benchmark's virtual environment and print its path (the last line of
# stdout); scripts/lib/engine_env.sh says where it lives (MILES_ASYNC_TRL_VENV, default
# ~/.cache/miles-async/venv-trl) and when it is rebuilt (benchmarks/requirements-trl.txt or the torch pin
# changed). Kept apart from the project's venv so TRL never moves the project's pins.
#   MILES_ASYNC_TORCH_SPEC, MILES_ASYNC_TORCH_INDEX_URL: which torch, from where (scripts/lib/torch_install.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/engine_env.sh
source "$ROOT/scripts/lib/engine_env.sh"
# shellcheck source=scripts/lib/torch_install.sh
source "$ROOT/scripts/lib/torch_install.sh"
REQ="$ROOT/benchmarks/requirements-trl.txt"

engine_build() {
  # torch first and pinned, so nothing below can pull another build.
  torch_install "$VENV" setup_trl_env
  "$VENV/bin/pip" install -r "$REQ"
  "$VENV/bin/python" -c "import trl"
}

engine_env trl "$REQ" "$TORCH_STAMP"
