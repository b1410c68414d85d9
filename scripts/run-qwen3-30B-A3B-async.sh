#!/usr/bin/env bash
# Fully-async GRPO for Qwen3-30B-A3B (MoE, 128 experts, top-8) on two nodes of 8 GPUs: Megatron trains
# on 8 GPUs (TP 4 with sequence parallelism x EP 8 with expert TP 1, so data parallel 2) while one SGLang
# engine of 8 GPUs generates. This is Miles' run-qwen3-30B-A3B.sh moved onto train_async.py: the same
# model, data, GRPO, optimizer and MoE settings, without --colocate (actor and rollout GPUs apart, so the
# engine never waits for the trainer and weights stream to it after every step).
#
#   HF_CHECKPOINT=/models/Qwen3-30B-A3B DATA_DIR=/data bash scripts/run-qwen3-30B-A3B-async.sh [--dry-run] [extra flags]
#
# MODEL_ARGS_FILE (default scripts/models/qwen3-30B-A3B.sh) is the model-args file sourced for
# MODEL_ARGS, e.g. scripts/models/qwen3-moe-tiny.sh for a CPU rehearsal with a tiny random Qwen3-MoE.
# REF_LOAD: a torch_dist checkpoint of the reference model, as Miles' launcher passes with --ref-load
# (default: the reference is --hf-checkpoint's weights).
#
# Extra flags are appended, so they override the defaults below; --dry-run prints the final command
# instead of running it. Ray: train_async.py starts a local Ray; with RAY_ADDRESS=host:port (e.g. under
# scripts/slurm/train-async.sbatch with LAUNCHER set to this script) it joins that cluster. A checkpoint
# in SAVE_DIR is resumed from (--load) when one exists.
#
# --check-config (an extra flag) checks the command without starting anything. The test suite runs this
# launcher so with Qwen3-30B-A3B's published config.json (tests/scripts/test_check_config.py). Miles'
# optimizer-memory flags (--optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d,
# --use-precision-aware-optimizer) and Transformer Engine's MoE kernels are warnings on a machine
# without GPUs or Transformer Engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/launch.sh
source "$ROOT/scripts/lib/launch.sh"
MODEL_ARGS_FILE="${MODEL_ARGS_FILE:-$ROOT/scripts/models/qwen3-30B-A3B.sh}"
# shellcheck source=scripts/models/qwen3-30B-A3B.sh
source "$MODEL_ARGS_FILE"
parse_launcher_args "$@"

PYTHON="${PYTHON:-python3}"
HF_CHECKPOINT="${HF_CHECKPOINT:-/root/models/Qwen3-30B-A3B}"
DATA_DIR="${DATA_DIR:-/root/data}"
SAVE_DIR="${SAVE_DIR:-/root/ckpt/qwen3-30B-A3B-async}"
OUT="${OUT:-$ROOT/outputs/qwen3-30B-A3B-async-$(date +%Y%m%d-%H%M%S)}"

CKPT_ARGS=(
  --hf-checkpoint "$HF_CHECKPOINT"
  --save "$SAVE_DIR"
  --save-interval 20
  --save-trigger-sentinel "$SAVE_DIR/SAVE_NOW"
)
if [ -n "${REF_LOAD:-}" ]; then
  CKPT_ARGS+=(--ref-load "$REF_LOAD")
fi
if [ -f "$SAVE_DIR/latest_checkpointed_iteration.txt" ]; then
  CKPT_ARGS+=(--load "$SAVE_DIR")
fi

ROLLOUT_ARGS=(
  --prompt-data "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl"
  --input-key prompt
  --label-key label
  --apply-chat-template
  --apply-chat-template-kwargs '{"enable_thinking":false}'
  --rollout-shuffle
  --rm-type math
  --num-rollout 3000
  --rollout-batch-size 32
  --n-samples-per-prompt 8
  --rollout-max-response-len 8192
  --rollout-temperature 0.8
  --global-batch-size 256
  --balance-data
)

EVAL_ARGS=(
  --eval-interval 20
  --eval-prompt-data aime "$DATA_DIR/aime-2024/aime-2024.jsonl"
  --n-samples-per-eval-prompt 16
  --eval-max-response-len 16384
  --eval-top-p 0.7
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --use-kl-loss
  --kl-loss-coef 0.00
  --kl-loss-type low_var_kl
  --entropy-coef 0.00
  --eps-clip 0.2
  --eps-clip-high 0.28
  # Not in Miles' colocated launcher: fully-async trains on samples of older weights, so it corrects for them.
  --use-tis
  --tis-clip 2.0
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
  --optimizer-cpu-offload
  --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer
)

# Megatron: 8 training GPUs = TP 4 x DP 2 for attention; the experts over EP 8 (expert TP 1).
TRAIN_ARGS=(
  --train-backend megatron
  --actor-num-nodes 1
  --actor-num-gpus-per-node 8
  --tensor-model-parallel-size 4
  --sequence-parallel
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu 20480
  --bf16
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --attention-backend flash
)

# SGLang: 8 rollout GPUs = one engine of TP 8; CUDA graphs for batches of 1, 2, 4, 8, then 16 to 256 by 8.
mapfile -t CUDA_GRAPH_BS < <(printf '%s\n' 1 2 4 8; seq 16 8 256)
ENGINE_ARGS=(
  --rollout-backend sglang
  --rollout-num-gpus 8
  --rollout-num-gpus-per-engine 8
  --sglang-mem-fraction-static 0.7
  --sglang-cuda-graph-bs "${CUDA_GRAPH_BS[@]}"
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
  "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" \
  "${TRAIN_ARGS[@]}" "${ENGINE_ARGS[@]}" "${ASYNC_ARGS[@]}" "${MISC_ARGS[@]}" "${LAUNCHER_ARGS[@]}"
