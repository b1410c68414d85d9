#!/usr/bin/env bash
# Fully-async GRPO for Qwen3-4B on one node of 8 GPUs: Megatron trains on 4 GPUs while
# SGLang generates on the other 4 (two engines of TP 2); nothing is colocated, so the
# engines never wait for the trainer and weights stream to them after every step.
#
#   HF_CHECKPOINT=/models/Qwen3-4B DATA_DIR=/data bash scripts/run-qwen3-4B-async.sh [--dry-run] [extra flags]
#
# MODEL_ARGS_FILE (default scripts/models/qwen3-4B.sh) is the model-args file sourced for MODEL_ARGS,
# e.g. scripts/models/qwen3-tiny.sh for a CPU rehearsal with a tiny random Qwen3.
#
# Extra flags are appended, so they override the defaults below; --dry-run prints the
# final command instead of running it. Ray: train_async.py starts a local Ray on this
# node; with RAY_ADDRESS=host:port (e.g. under scripts/slurm/train-async.sbatch) it joins
# that cluster. A checkpoint in SAVE_DIR is resumed from (--load) when one exists.
#
# --check-config (an extra flag) checks the command without starting anything: MODEL_ARGS against
# $HF_CHECKPOINT/config.json, the data files and their keys, every flag, and prints the resolved
# configuration and the worker plan (exit 0, or 2 with the reason). What only the GPU node can tell
# (GPUs, Transformer Engine for --sequence-parallel, SGLang) is a warning there. The test suite runs
# this launcher so with Qwen3-4B's published config.json (tests/scripts/test_check_config.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/launch.sh
source "$ROOT/scripts/lib/launch.sh"
MODEL_ARGS_FILE="${MODEL_ARGS_FILE:-$ROOT/scripts/models/qwen3-4B.sh}"
# shellcheck source=scripts/models/qwen3-4B.sh
source "$MODEL_ARGS_FILE"
parse_launcher_args "$@"

PYTHON="${PYTHON:-python3}"
HF_CHECKPOINT="${HF_CHECKPOINT:-/root/models/Qwen3-4B}"
DATA_DIR="${DATA_DIR:-/root/data}"
SAVE_DIR="${SAVE_DIR:-/root/ckpt/qwen3-4B-async}"
OUT="${OUT:-$ROOT/outputs/qwen3-4B-async-$(date +%Y%m%d-%H%M%S)}"

CKPT_ARGS=(
  --hf-checkpoint "$HF_CHECKPOINT"
  --save "$SAVE_DIR"
  --save-interval 20
  --save-trigger-sentinel "$SAVE_DIR/SAVE_NOW"
)
if [ -f "$SAVE_DIR/latest_checkpointed_iteration.txt" ]; then
  CKPT_ARGS+=(--load "$SAVE_DIR")
fi

ROLLOUT_ARGS=(
  --prompt-data "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl"
  --input-key prompt
  --label-key label
  --apply-chat-template
  --rollout-shuffle
  --rm-type deepscaler
  --num-rollout 3000
  --rollout-batch-size 32
  --n-samples-per-prompt 8
  --rollout-max-response-len 8192
  --rollout-temperature 1.0
  --global-batch-size 256
)

EVAL_ARGS=(
  --eval-prompt-data aime "$DATA_DIR/aime-2024/aime-2024.jsonl"
  --eval-interval 20
  --n-samples-per-eval-prompt 16
  --eval-max-response-len 16384
  --eval-temperature 1.0
  --eval-top-p 1.0
)

ALGO_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --eps-clip-high 0.28
  --use-tis
  --tis-clip 2.0
  --entropy-coef 0.0
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
  --clip-grad 1.0
)

# Megatron: 4 training GPUs = TP 2 x DP 2, with sequence parallelism and a sharded optimizer.
TRAIN_ARGS=(
  --train-backend megatron
  --actor-num-nodes 1
  --actor-num-gpus-per-node 4
  --tensor-model-parallel-size 2
  --sequence-parallel
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --use-distributed-optimizer
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu 9216
  --bf16
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
)

# SGLang: 4 rollout GPUs = 2 engines of TP 2.
ENGINE_ARGS=(
  --rollout-backend sglang
  --rollout-num-gpus 4
  --rollout-num-gpus-per-engine 2
  --sglang-mem-fraction-static 0.8
)

ASYNC_ARGS=(
  --fully-async
  --max-staleness-steps 2
  --update-weights-interval 1
  --partial-rollout
)

MISC_ARGS=(
  --output-dir "$OUT"
  --seed 1234
)
if [ -n "${RAY_ADDRESS:-}" ]; then
  MISC_ARGS+=(--ray-address "$RAY_ADDRESS")
fi

cd "$ROOT"
# Megatron's tensor/sequence parallel overlap needs one CUDA connection per device.
launch env CUDA_DEVICE_MAX_CONNECTIONS=1 "$PYTHON" "$ROOT/train_async.py" "${MODEL_ARGS[@]}" \
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${ALGO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
  "${TRAIN_ARGS[@]}" "${ENGINE_ARGS[@]}" "${ASYNC_ARGS[@]}" "${MISC_ARGS[@]}" "${LAUNCHER_ARGS[@]}"
