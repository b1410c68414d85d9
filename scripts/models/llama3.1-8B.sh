# shellcheck shell=bash
# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 32 layers, hidden 4096, GQA 32 heads /
# 8 KV groups of head_dim 128, SwiGLU FFN 14336, RMSNorm eps 1e-5, RoPE theta 5e5 with the
# llama3 frequency scaling (factor 8, original context 8192), vocab 128256, no biases,
# separate input/output embeddings.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --num-layers 32
  --hidden-size 4096
  --ffn-hidden-size 14336
  --swiglu
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --disable-bias-linear
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --position-embedding-type rope
  --rotary-base 500000
  --use-rope-scaling
  --rope-scaling-factor 8.0
  --max-position-embeddings 131072
  --vocab-size 128256
  --untie-embeddings-and-output-weights
)
