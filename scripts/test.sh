#!/usr/bin/env bash
# The README's test command: set up (or reuse) the environment, then run the whole test suite.
# Arguments go to pytest; with no test path among them pytest runs tests/ (pytest.ini's
# testpaths), with one it runs just that: bash scripts/test.sh tests/scripts -q
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest "$@"
