# shellcheck shell=bash
# A tiny random Qwen3-MoE for rehearsals on a CPU machine: the config.json of
# miles_async/assets/tiny_model.py's make_tiny_model(arch="qwen3_moe", tied=False): 2 layers, both MoE (4 experts
# of FFN 32, top-2 with softmax scores renormalised), hidden 64, GQA 4 heads / 2 KV groups of head_dim
# 16, RMSNorm eps 1e-6, RoPE theta 1e4, vocab 54 (its character tokenizer), QK-norm, no biases, an output
# layer of its own (SGLang's CPU server gave the tied one uniform logits): the shape of Qwen3-30B-A3B at toy
# size, with the same MoE layer settings. Use it with
# scripts/run-qwen3-30B-A3B-async.sh through MODEL_ARGS_FILE.
# Sourced by launchers: defines MODEL_ARGS (Megatron-LM flag names).
# shellcheck disable=SC2034  # MODEL_ARGS is read by the script that sources this file
MODEL_ARGS=(
  --disable-bias-linear
  --untie-embeddings-and-output-weights
  --qk-layernorm
  --group-query-attention
  --num-attention-heads 4
  --num-query-groups 2
  --kv-channels 16
  --num-layers 2
  --hidden-size 64
  --ffn-hidden-size 128
  --normalization RMSNorm
  --position-embedding-type rope
  --norm-epsilon 1e-6
  --rotary-percent 1.0
  --swiglu
  --vocab-size 54
  --rotary-base 10000
  --max-position-embeddings 512
  --moe-ffn-hidden-size 32
  --moe-router-score-function softmax
  --moe-token-dispatcher-type alltoall
  --moe-router-topk 2
  --moe-layer-freq "[1,1]"
  --num-experts 4
  --moe-grouped-gemm
  --moe-token-drop-policy probs
  --moe-router-dtype fp32
  --moe-permute-fusion
  --moe-aux-loss-coeff 0
)
