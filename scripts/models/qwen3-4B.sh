# shellcheck shell=bash
# Qwen3-4B (Qwen/Qwen3-4B config.json): 36 layers, hidden 2560, GQA 32 heads / 8 KV groups of
# head_dim 128 (4096 = 32 x 128, wider than hidden), SwiGLU FFN 9728, RMSNorm eps 1e-6,
# RoPE theta 1e6, vocab 151936, QK-norm, no biases, tied input/output embeddings.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --num-layers 36
  --hidden-size 2560
  --ffn-hidden-size 9728
  --swiglu
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --qk-layernorm
  --disable-bias-linear
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --position-embedding-type rope
  --rotary-base 1000000
  --max-position-embeddings 40960
  --vocab-size 151936
)
