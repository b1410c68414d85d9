#!/usr/bin/env bash
# GPU check of SGLang's NCCL weight route (update_weights_from_distributed), which the CPU tests cannot
# run. Needs one NVIDIA GPU: the SGLang server (its full CUDA environment) and a "trainer" (this
# project's environment, CUDA torch) share it.
#   bash scripts/gpu/check_sglang_nccl.sh [MODEL_DIR]      (default: the tiny llama built on the fly)
# What it checks (check_sglang_nccl.py), through the trainer's own EngineWeightGroup (the same code the CPU
# tests run over gloo): the server starts on the GPU, /init_weights_update_group joins
# an NCCL group with the trainer's rank 0, perturbed weights broadcast in buckets of
# --update-weight-buffer-size bytes under their HF names reach the engine (/update_weights_from_distributed,
# version in the last bucket) straight from the trainer's GPU memory (every broadcast tensor is on the GPU and
# no op of the bucketing or the push copies a weight to the CPU), the version is reported, the engine's
# weights (/get_weights_by_name) equal the trainer's bit for bit, greedy outputs change and the engine's
# log-probs equal transformers' on the same weights. Prints PASS or fails with the reason; exits 2 at once
# when no GPU is visible.
# Time: the SGLang environment build (once, ~10 min, ~11 GB), then about a minute.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_sglang_check.sh" check_sglang_nccl "$@"
