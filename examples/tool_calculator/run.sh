#!/usr/bin/env bash
# Asynchronous GRPO on the CPU with a tool: SmolLM2-135M-Instruct learns to call a calculator for
# three-digit by two-digit multiplication (see README.md). Each sample is a conversation of up to two
# assistant turns: a tool call, the calculator's result, the answer.
#
#   bash examples/tool_calculator/run.sh [--dry-run] [--check-config] [extra flags]
#
# Extra flags are appended, so they override the defaults below; --dry-run prints the final command
# instead of running it. MODEL, DATA, OUT and PYTHON may be set to skip the setup (the venv, the model
# download, the data); by default they come from scripts/setup_env.sh and $MILES_ASYNC_CACHE.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# shellcheck source=scripts/lib/launch.sh
source "$ROOT/scripts/lib/launch.sh"
parse_launcher_args "$@"
CACHE="${MILES_ASYNC_CACHE:-$HOME/.cache/miles-async}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false

if [ -z "${PYTHON:-}" ]; then
  PYTHON="$(bash "$ROOT/scripts/setup_env.sh")/bin/python"
fi
if [ -z "${MODEL:-}" ]; then
  MODEL="$("$PYTHON" -m miles_async.assets.smollm2 --cache-dir "$CACHE")"
fi
if [ -z "${DATA:-}" ]; then
  DATA="$CACHE/data/tool_calculator"
  "$PYTHON" -m examples.tool_calculator.data --out "$DATA" >/dev/null
fi
OUT="${OUT:-$ROOT/outputs/tool-calculator-$(date +%Y%m%d-%H%M%S)}"

CKPT_ARGS=(
  --hf-checkpoint "$MODEL"
  --save "$OUT/ckpt"
  --save-interval 8
  --save-trigger-sentinel "$OUT/SAVE_NOW"
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA/train.jsonl"
  --input-key prompt
  --label-key label
  --apply-chat-template
  --rollout-shuffle
  --custom-rm-path examples.tool_calculator.reward.final_answer_reward
  --num-rollout 8
  --rollout-batch-size 8
  --n-samples-per-prompt 8
  --rollout-max-response-len 80
  --rollout-temperature 1.0
)
TOOL_ARGS=(
  --tools-path examples.tool_calculator.tools.TOOLS
  --max-turns 2
  --tool-timeout 10
  --tool-workers 2
)
EVAL_ARGS=(
  --eval-prompt-data mul_tool "$DATA/eval.jsonl"
  --eval-interval 8
  --n-samples-per-eval-prompt 2
  --eval-temperature 1.0
  --eval-max-response-len 80
)
ALGO_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --use-tis
  --tis-clip 2.0
)
# A group is one ~250-token prompt (system message and two worked examples) and 8 responses of up to 80 tokens;
# micro-batches of one or two groups keep the trainer's memory at a few GB (64 samples in one pass took 18 GB).
TRAIN_ARGS=(
  --max-tokens-per-gpu 1024
)
OPTIMIZER_ARGS=(
  --lr 1e-4
  --clip-grad 1.0
  --bf16
)
ENGINE_ARGS=(
  --rollout-backend embedded
  --rollout-num-gpus 1
)
MISC_ARGS=(
  --update-weights-interval 1
  --output-dir "$OUT"
  --seed 1234
)
if [ -n "${RAY_ADDRESS:-}" ]; then
  MISC_ARGS+=(--ray-address "$RAY_ADDRESS")
fi

cd "$ROOT"
launch "$PYTHON" "$ROOT/train_async.py" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TOOL_ARGS[@]}" "${EVAL_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${ENGINE_ARGS[@]}" "${MISC_ARGS[@]}" "${LAUNCHER_ARGS[@]}"
