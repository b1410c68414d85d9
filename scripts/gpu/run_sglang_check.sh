#!/usr/bin/env bash
# Runs one SGLang GPU check, scripts/gpu/CHECK.py, with this project's environment (the "trainer") and SGLang's
# full CUDA environment (the engine), built once each; see each check's .sh for what it checks.
#   bash scripts/gpu/run_sglang_check.sh CHECK [ARGS...]
# Without a visible GPU it stops at once (exit 2), before building SGLang's environment.
set -euo pipefail
CHECK="$1"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -c "import sys; sys.path.insert(0, 'scripts/gpu'); import sglang_gpu; sglang_gpu.require_gpu('$CHECK')"
SGLANG_VENV="$(MILES_ASYNC_SGLANG_FULL=1 MILES_ASYNC_SGLANG_VENV="${MILES_ASYNC_SGLANG_VENV:-$HOME/.cache/miles-async/venv-sglang-gpu}" \
  bash "$ROOT/scripts/setup_sglang_env.sh" | tail -1)"
exec "$VENV/bin/python" "scripts/gpu/$CHECK.py" --sglang-python "$SGLANG_VENV/bin/python" "$@"
