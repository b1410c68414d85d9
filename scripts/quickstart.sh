#!/usr/bin/env bash
# The README's first command: a real asynchronous GRPO run on the CPU.
# SmolLM2-135M-Instruct learns single-digit multiplication; held-out accuracy is
# evaluated before training and periodically in the background.
# Extra flags are passed on to train_async.py (e.g. --num-rollout 10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
CACHE="${MILES_ASYNC_CACHE:-$HOME/.cache/miles-async}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

MODEL="$("$VENV/bin/python" -m miles_async.assets.smollm2 --cache-dir "$CACHE")"
DATA="$CACHE/data/mul"
"$VENV/bin/python" -m miles_async.assets.arith_dataset --task mul --out "$DATA" >/dev/null

MODEL="$MODEL" DATA="$DATA" PYTHON="$VENV/bin/python" exec bash "$ROOT/scripts/run-smollm2-cpu-async.sh" "$@"
