#!/usr/bin/env bash
# GPU check of SGLang's same-node tensor route with CUDA IPC handles (--weight-update-method tensor, the GPU
# twin of the shared-memory files the CPU tests use), which the CPU tests cannot run. Needs one NVIDIA GPU:
# the SGLang server (its full CUDA environment) and a "trainer" (this project's environment, CUDA torch)
# share it.
#   bash scripts/gpu/check_sglang_cuda_ipc.sh [MODEL_DIR]   (default: the tiny llama built on the fly; a
#                                                          Llama-family model, for /get_weights_by_name)
# What it checks (check_sglang_cuda_ipc.py), through the trainer's own WeightSender (what push_weights runs):
# an fp32 "trainer" model on the GPU, perturbed, is bucketed in the engine's bf16 on the GPU and handed to
# the engine as CUDA IPC handles (/update_weights_from_tensor, one pickle per TP rank, the GPU named by its
# UUID): every tensor handed over is the bucket's own GPU tensor (no copy) and no op of the bucketing or the
# push copies a weight to the CPU; the engine reports the version and its weights (/get_weights_by_name)
# equal the trainer's cast to bf16, bit for bit; a second push (new weights, version 2) does the same, and
# greedy outputs change. Prints PASS or fails with the reason; exits 2 at once when no GPU is visible.
# Time: the SGLang environment build (once, ~10 min, ~11 GB), then about a minute.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_sglang_check.sh" check_sglang_cuda_ipc "$@"
