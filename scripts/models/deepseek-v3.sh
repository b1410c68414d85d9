# shellcheck shell=bash
# DeepSeek-V3 / DeepSeek-R1 (deepseek-ai's config.json): 61 layers, the first 3 dense (FFN 18432) and the
# rest MoE (256 routed experts of FFN 2048 in 8 groups, top-8 from the best 4 groups, sigmoid scores plus an
# expert bias, weights scaled by 2.5, one shared expert), hidden 7168, multi-latent attention (128 heads, query
# rank 1536, key/value latent 512, 128-wide heads plus a 64-wide RoPE part, 128-wide values, YaRN factor 40),
# RMSNorm eps 1e-6, vocab 129280, untied embeddings. The flags are Miles' MODEL_ARGS for this model.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
NLAYERS=61
FIRST_K_DENSE_REPLACE=3
MOE_LAYER_FREQ="[$(printf '0,%.0s' $(seq 1 "$FIRST_K_DENSE_REPLACE"))$(printf '1,%.0s' $(seq 2 $((NLAYERS - FIRST_K_DENSE_REPLACE))))1]"
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --disable-bias-linear
  --num-layers "$NLAYERS"
  --hidden-size 7168
  --ffn-hidden-size 18432
  --num-attention-heads 128
  --kv-channels 128
  --normalization RMSNorm
  --position-embedding-type rope
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --vocab-size 129280
  --multi-latent-attention
  --q-lora-rank 1536
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
  --qk-layernorm
  --rotary-scaling-factor 40
  --rotary-base 10000
  --mscale 1.0
  --mscale-all-dim 1.0
  --attention-softmax-in-fp32
  --no-rope-fusion
  --num-experts 256
  --moe-layer-freq "$MOE_LAYER_FREQ"
  --moe-ffn-hidden-size 2048
  --moe-router-topk 8
  --moe-shared-expert-intermediate-size 2048
  --moe-router-pre-softmax
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-load-balancing-type seq_aux_loss
  --moe-token-dispatcher-type alltoall
  --moe-aux-loss-coeff 0
  --moe-router-bias-update-rate 0
  --moe-router-group-topk 4
  --moe-router-num-groups 8
  --moe-grouped-gemm
  --moe-router-topk-scaling-factor 2.5
  --moe-router-dtype fp32
  --moe-permute-fusion
)
