# shellcheck shell=bash
# A tiny random Qwen3 for rehearsals on a CPU machine (tests/scripts/test_check_config.py):
# the config.json of miles_async/assets/tiny_model.py's make_tiny_model(arch="qwen3"): 2 layers,
# hidden 64, GQA 4 heads / 2 KV groups of head_dim 16, SwiGLU FFN 128, RMSNorm eps 1e-6, RoPE theta
# 1e4, vocab 54 (its character tokenizer), QK-norm, no biases, tied input/output embeddings: the
# shape of Qwen3-4B at toy size. Use it with scripts/run-qwen3-4B-async.sh through MODEL_ARGS_FILE.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --num-layers 2
  --hidden-size 64
  --ffn-hidden-size 128
  --swiglu
  --num-attention-heads 4
  --group-query-attention
  --num-query-groups 2
  --kv-channels 16
  --qk-layernorm
  --disable-bias-linear
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --position-embedding-type rope
  --rotary-base 10000
  --max-position-embeddings 512
  --vocab-size 54
)
