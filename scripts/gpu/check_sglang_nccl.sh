#!/usr/bin/env bash
# GPU check of SGLang's NCCL weight route (update_weights_from_distributed), which the CPU tests cannot
# run. Needs one NVIDIA GPU: the SGLang server (its full CUDA environment) and a "trainer" (this
# project's environment, CUDA torch) share it.
#   bash scripts/gpu/check_sglang_nccl.sh [MODEL_DIR]      (default: the tiny llama built on the fly)
# What it checks (check_sglang_nccl.py), through the trainer's own EngineWeightGroup (the same code the CPU
# tests run over gloo): the server starts on the GPU, /init_weights_update_group joins
# an NCCL group with the trainer's rank 0, perturbed weights broadcast in buckets of
# --update-weight-buffer-size bytes under their HF names reach the engine (/update_weights_from_distributed,
# version in the last bucket), the version is reported, greedy outputs change and the engine's
# log-probs equal transformers' on the same weights. Prints PASS or fails with the reason.
# Time: the SGLang environment build (once, ~10 min, ~11 GB), then about a minute.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
SGLANG_VENV="$(MILES_ASYNC_SGLANG_FULL=1 MILES_ASYNC_SGLANG_VENV="${MILES_ASYNC_SGLANG_VENV:-$HOME/.cache/miles-async/venv-sglang-gpu}" \
  bash "$ROOT/scripts/setup_sglang_env.sh" | tail -1)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" scripts/gpu/check_sglang_nccl.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
