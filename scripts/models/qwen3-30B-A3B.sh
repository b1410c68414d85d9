# shellcheck shell=bash
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, every one MoE (128 experts of FFN 768,
# top-8 with softmax scores renormalised), hidden 2048, GQA 32 heads / 4 KV groups of head_dim 128,
# RMSNorm eps 1e-6, RoPE theta 1e6, vocab 151936, QK-norm, no biases, untied embeddings. The flags
# are Miles' MODEL_ARGS for this model, with its MoE layer settings: alltoall dispatch (which expert
# parallelism needs), an fp32 router, no load-balancing loss, and Transformer Engine's grouped GEMM
# and fused permutation (each a warning where Transformer Engine is absent).
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
NLAYERS=48
# Every layer is MoE: [1,1,...,1], Megatron-LM's per-layer pattern.
MOE_LAYER_FREQ="[$(printf '1,%.0s' $(seq 2 "$NLAYERS"))1]"
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --disable-bias-linear
  --qk-layernorm
  --group-query-attention
  --num-attention-heads 32
  --num-query-groups 4
  --kv-channels 128
  --num-layers "$NLAYERS"
  --hidden-size 2048
  --ffn-hidden-size 6144
  --normalization RMSNorm
  --position-embedding-type rope
  --norm-epsilon 1e-6
  --rotary-percent 1.0
  --swiglu
  --untie-embeddings-and-output-weights
  --vocab-size 151936
  --rotary-base 1000000
  --moe-ffn-hidden-size 768
  --moe-router-score-function softmax
  --moe-token-dispatcher-type alltoall
  --moe-router-topk 8
  --moe-layer-freq "$MOE_LAYER_FREQ"
  --num-experts 128
  --moe-grouped-gemm
  --moe-token-drop-policy probs
  --moe-router-dtype fp32
  --moe-permute-fusion
  --moe-aux-loss-coeff 0
)
