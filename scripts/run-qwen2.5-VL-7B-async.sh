#!/usr/bin/env bash
# One-step-off GRPO for Qwen2.5-VL-7B-Instruct on geometry problems with a figure (geo3k), on one node of 8 GPUs:
# the torch backend (FSDP2) trains on 4 GPUs while 4 SGLang engines of 1 GPU generate. This is Miles' VLM
# launcher (examples/geo3k_vlm/run_geo3k_vlm.sh, its fsdp backend) moved onto train_async.py: the same data,
# keys, reward, GRPO and optimizer settings and the same --multimodal-keys, without --colocate (actor and rollout
# GPUs apart), on Qwen2.5-VL (Miles' defaults to Qwen3-VL, whose vision tower this project does not build yet).
#
#   HF_CHECKPOINT=/models/Qwen2.5-VL-7B-Instruct DATA_DIR=/data bash scripts/run-qwen2.5-VL-7B-async.sh [--dry-run] [extra flags]
#
# DATA_DIR holds geo3k_imgurl/{train,test}.parquet (the chenhegu/geo3k_imgurl dataset Miles downloads): a
# "problem", an "answer" and an "images" column (each image a path, a data: URI or base64; docs/guides/vision.md).
# Extra flags are appended, so they override the defaults below; --dry-run prints the final command instead of
# running it. --check-config (an extra flag) checks the command without starting anything; the test suite runs this
# launcher so against Qwen2.5-VL-7B-Instruct's published config.json (tests/scripts/test_check_config.py). Miles'
# --attn-implementation flash_attention_3 is left out: the torch backend picks the model's attention itself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/launch.sh
source "$ROOT/scripts/lib/launch.sh"
parse_launcher_args "$@"

PYTHON="${PYTHON:-python3}"
HF_CHECKPOINT="${HF_CHECKPOINT:-/root/models/Qwen2.5-VL-7B-Instruct}"
DATA_DIR="${DATA_DIR:-/root/datasets}"
SAVE_DIR="${SAVE_DIR:-/root/ckpt/qwen2.5-VL-7B-async}"
OUT="${OUT:-$ROOT/outputs/qwen2.5-VL-7B-async-$(date +%Y%m%d-%H%M%S)}"

CKPT_ARGS=(
  --hf-checkpoint "$HF_CHECKPOINT"
  --save "$SAVE_DIR"
  --save-interval 20
)
if [ -f "$SAVE_DIR/latest_checkpointed_iteration.txt" ]; then
  CKPT_ARGS+=(--load "$SAVE_DIR")
fi

ROLLOUT_ARGS=(
  --prompt-data "$DATA_DIR/geo3k_imgurl/train.parquet"
  --input-key problem
  --label-key answer
  --multimodal-keys '{"image": "images"}'
  --apply-chat-template
  --rollout-shuffle
  --rm-type math
  --num-rollout 3000
  --rollout-batch-size 64
  --n-samples-per-prompt 8
  --rollout-max-response-len 4096
  --rollout-temperature 0.8
  --global-batch-size 512
)

EVAL_ARGS=(
  --eval-interval 20
  --eval-prompt-data geo3k_imgurl "$DATA_DIR/geo3k_imgurl/test.parquet"
  --n-samples-per-eval-prompt 1
  --eval-max-response-len 4096
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --kl-loss-coef 0.00
  --kl-loss-type low_var_kl
  --kl-coef 0.00
  --entropy-coef 0.00
  --eps-clip 0.2
  --eps-clip-high 0.28
  # Not in Miles' colocated launcher: one-step-off trains on samples of the weights before, so it corrects for them.
  --use-tis
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
)

TRAIN_ARGS=(
  --train-backend fsdp
  --actor-num-nodes 1
  --actor-num-gpus-per-node 4
  --gradient-checkpointing
  --update-weight-buffer-size 536870912
  --bf16
)

# SGLang: 4 rollout GPUs = 4 engines of 1 GPU; CUDA graphs for batches of 1, 2, 4, 8, then 16 to 256 by 8.
mapfile -t CUDA_GRAPH_BS < <(printf '%s\n' 1 2 4 8; seq 16 8 256)
ENGINE_ARGS=(
  --rollout-backend sglang
  --rollout-num-gpus 4
  --rollout-num-gpus-per-engine 1
  --sglang-mem-fraction-static 0.6
  --sglang-attention-backend fa3
  --sglang-cuda-graph-bs "${CUDA_GRAPH_BS[@]}"
)

MISC_ARGS=(
  --output-dir "$OUT"
  --seed 1234
)
if [ -n "${RAY_ADDRESS:-}" ]; then
  MISC_ARGS+=(--ray-address "$RAY_ADDRESS")
fi

cd "$ROOT"
launch "$PYTHON" "$ROOT/train_async.py" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${TRAIN_ARGS[@]}" "${ENGINE_ARGS[@]}" "${MISC_ARGS[@]}" "${LAUNCHER_ARGS[@]}"
