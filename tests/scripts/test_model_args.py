"""scripts/models/*.sh: the Megatron MODEL_ARGS of each model carry its published
config.json values, and an HF model built from those flags (on the meta device, no
weights) has exactly the published parameter count, so a wrong width, depth, vocabulary,
bias or tying flag cannot pass."""

from __future__ import annotations

import subprocess

import pytest

from tests.scripts.helpers import ROOT

# From each model's config.json on its hub page; params = the safetensors total.
PUBLISHED = {
    "qwen3-4B": dict(
        arch="qwen3",
        num_hidden_layers=36,
        hidden_size=2560,
        intermediate_size=9728,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        params=4_022_468_096,
    ),
    "qwen2.5-7B": dict(
        arch="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        vocab_size=152064,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        params=7_615_616_512,
    ),
    "llama3.1-8B": dict(
        arch="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling_factor=8.0,
        params=8_030_261_248,
    ),
}

VALUE_FLAGS = {
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--num-query-groups",
    "--kv-channels",
    "--normalization",
    "--norm-epsilon",
    "--position-embedding-type",
    "--rotary-base",
    "--max-position-embeddings",
    "--vocab-size",
    "--rope-scaling-factor",
}
SWITCHES = {
    "--swiglu",
    "--group-query-attention",
    "--qk-layernorm",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--untie-embeddings-and-output-weights",
    "--use-rope-scaling",
}


def model_args(name: str) -> dict:
    """Source the model script in bash and parse its MODEL_ARGS array (switches map to True)."""
    script = ROOT / "scripts" / "models" / f"{name}.sh"
    out = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$1"; printf "%s\\0" "${MODEL_ARGS[@]}"', "_", str(script)],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    words = out.split("\0")[:-1]
    args, i = {}, 0
    while i < len(words):
        flag = words[i]
        assert flag not in args, f"{name}: {flag} given twice"
        if flag in SWITCHES:
            args[flag], i = True, i + 1
        else:
            assert flag in VALUE_FLAGS, f"{name}: unexpected word {flag!r} in MODEL_ARGS"
            args[flag], i = words[i + 1], i + 2
    return args


def hf_config(args: dict):
    """The HF config those Megatron flags describe."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        num_hidden_layers=int(args["--num-layers"]),
        hidden_size=int(args["--hidden-size"]),
        intermediate_size=int(args["--ffn-hidden-size"]),
        num_attention_heads=int(args["--num-attention-heads"]),
        num_key_value_heads=int(args["--num-query-groups"]),
        vocab_size=int(args["--vocab-size"]),
        rms_norm_eps=float(args["--norm-epsilon"]),
        tie_word_embeddings=not args.get("--untie-embeddings-and-output-weights", False),
        max_position_embeddings=int(args["--max-position-embeddings"]),
    )
    if args.get("--qk-layernorm"):
        return Qwen3Config(head_dim=int(args["--kv-channels"]), **common)
    if args.get("--add-qkv-bias"):
        assert int(args["--kv-channels"]) * int(args["--num-attention-heads"]) == int(args["--hidden-size"])
        return Qwen2Config(**common)
    return LlamaConfig(head_dim=int(args["--kv-channels"]), attention_bias=False, mlp_bias=False, **common)


def count_params(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_args_carry_the_published_config(name):
    want, args = PUBLISHED[name], model_args(name)
    assert int(args["--num-layers"]) == want["num_hidden_layers"]
    assert int(args["--hidden-size"]) == want["hidden_size"]
    assert int(args["--ffn-hidden-size"]) == want["intermediate_size"]
    assert int(args["--num-attention-heads"]) == want["num_attention_heads"]
    assert int(args["--num-query-groups"]) == want["num_key_value_heads"]
    assert int(args["--kv-channels"]) == want["head_dim"]
    assert float(args["--norm-epsilon"]) == want["rms_norm_eps"]
    assert float(args["--rotary-base"]) == want["rope_theta"]
    assert int(args["--vocab-size"]) == want["vocab_size"]
    assert int(args["--max-position-embeddings"]) == want["max_position_embeddings"]
    assert args.get("--untie-embeddings-and-output-weights", False) == (not want["tie_word_embeddings"])
    # Every one of these is a SwiGLU, RMSNorm, bias-free-linear, GQA, RoPE decoder.
    assert args["--swiglu"] and args["--disable-bias-linear"] and args["--group-query-attention"]
    assert args["--normalization"] == "RMSNorm" and args["--position-embedding-type"] == "rope"
    assert args.get("--qk-layernorm", False) == (want["arch"] == "qwen3")
    assert args.get("--add-qkv-bias", False) == (want["arch"] == "qwen2")
    assert args.get("--use-rope-scaling", False) == ("rope_scaling_factor" in want)
    if "rope_scaling_factor" in want:
        assert float(args["--rope-scaling-factor"]) == want["rope_scaling_factor"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_args_build_a_model_of_the_published_size(name):
    config = hf_config(model_args(name))
    assert config.model_type == PUBLISHED[name]["arch"]
    assert count_params(config) == PUBLISHED[name]["params"]
