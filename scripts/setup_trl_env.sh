#!/usr/bin/env bash
# Create (once) or reuse the TRL peer benchmark's virtual environment and print its path (the last line of
# stdout); scripts/lib/engine_env.sh says where it lives (MILES_ASYNC_TRL_VENV, default
# ~/.cache/miles-async/venv-trl) and when it is rebuilt (benchmarks/requirements-trl.txt or the torch pin
# changed). Kept apart from the project's venv so TRL never moves the project's pins.
#   MILES_ASYNC_TORCH_SPEC    the torch to install first (default torch==2.13.0: the CPU build here)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/engine_env.sh
source "$ROOT/scripts/lib/engine_env.sh"
TORCH_SPEC="${MILES_ASYNC_TORCH_SPEC:-torch==2.13.0}"
REQ="$ROOT/benchmarks/requirements-trl.txt"

engine_build() {
  # torch first and pinned, so nothing below can pull a multi-GB CUDA build on a CPU machine.
  "$VENV/bin/pip" install "$TORCH_SPEC"
  "$VENV/bin/pip" install -r "$REQ"
  "$VENV/bin/python" -c "import trl"
}

engine_env trl "$REQ" "$TORCH_SPEC"
