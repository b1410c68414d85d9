#!/usr/bin/env bash
# One-GPU check of the Megatron training backend's GPU path (no CPU shim):
#   1. a tiny Llama, a tiny Qwen3 and a tiny Qwen3-MoE (and every --model HF folder) give the same fp32 logits
#      through transformers and through the converted Megatron GPTModel, and HF -> Megatron -> HF is exact
#      (with Transformer Engine the MoE layers run its grouped GEMM and fused permutation);
#   2. MegatronTrainActor takes one rollout's optimizer steps on the GPU (Megatron DDP, optimizer, schedule).
#
# Needs: one CUDA GPU, a Python 3.11+ environment with a CUDA torch and transformers, and megatron-core.
# megatron-core can come from the wheel carried along (no network needed):
#   pip install --no-deps megatron_core-0.16.1-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#   pip install psutil   # used by megatron-core's checkpoint writer only
# Transformer Engine is optional: with it the TE layer spec is checked, without it the local spec.
#
# Run from anywhere:
#   bash scripts/gpu/check_megatron_gpu.sh [--model /path/to/hf_folder ...]
# Environment: PYTHON (default: python3) picks the interpreter. Prints one JSON line per check, then OK
# (exit 0) or FAILED (exit 1); exit 2 when no GPU is visible.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1
exec "$PYTHON" "$ROOT/scripts/gpu/check_megatron_gpu.py" "$@"
