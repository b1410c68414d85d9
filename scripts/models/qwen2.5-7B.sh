# shellcheck shell=bash
# Qwen2.5-7B (Qwen/Qwen2.5-7B config.json): 28 layers, hidden 3584, GQA 28 heads / 4 KV groups
# of head_dim 128, SwiGLU FFN 18944, RMSNorm eps 1e-6, RoPE theta 1e6, vocab 152064,
# bias on the Q/K/V projections only, separate input/output embeddings.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --num-layers 28
  --hidden-size 3584
  --ffn-hidden-size 18944
  --swiglu
  --num-attention-heads 28
  --group-query-attention
  --num-query-groups 4
  --kv-channels 128
  --disable-bias-linear
  --add-qkv-bias
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --position-embedding-type rope
  --rotary-base 1000000
  --max-position-embeddings 131072
  --vocab-size 152064
  --untie-embeddings-and-output-weights
)
