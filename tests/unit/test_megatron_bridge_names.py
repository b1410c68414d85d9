"""mbridge's tables name this backend's local-spec parameters (backends/megatron/bridge.py): a layer norm the
Transformer Engine spec fuses into a projection, a routed expert under its global number, a dense layer of a
Qwen2-MoE (mbridge's Qwen2 table), Mistral (Llama's names), and a family mbridge has no bridge of. The loads and
exports through these names are checked bit for bit by tests/integration/test_megatron_backend.py and
test_megatron_moe.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mbridge", reason="mbridge is installed with the Megatron backend (requirements-megatron.txt)")

from miles_async.backends.megatron.bridge import Names  # noqa: E402


def _config(model_type: str, **extra):
    from transformers import AutoConfig

    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    return AutoConfig.for_model(model_type, **base, **extra)


def test_local_spec_names_map_through_mbridges_tables():
    names = Names(_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16))
    norm = names.lookup(names.te_name("decoder.layers.0.input_layernorm.weight", 3))
    assert (norm.te_name, norm.hf_names) == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
        ["model.layers.3.input_layernorm.weight"],
    )
    expert = names.lookup(names.te_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", 5, 6))
    assert expert.hf_names == [
        "model.layers.5.mlp.experts.6.gate_proj.weight",
        "model.layers.5.mlp.experts.6.up_proj.weight",
    ]
    gate, up = torch.ones(16, 32), torch.zeros(16, 32)
    assert [n for n, _ in expert.to_hf(expert.to_mcore([gate, up]))] == expert.hf_names

    dense = Names(_config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, mlp_only_layers=[0]))  # fmt: skip
    assert dense.lookup(dense.te_name("decoder.layers.0.mlp.linear_fc1.weight", 0)).hf_names == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    mistral = Names(_config("mistral"))
    assert mistral.lookup(["decoder.layers.2.self_attention.linear_proj.weight"]).hf_names == [
        "model.layers.2.self_attn.o_proj.weight"
    ]
    with pytest.raises(NotImplementedError, match="no bridge for model_type 'gpt_oss'"):
        Names(_config("gpt_oss", num_local_experts=4, num_experts_per_tok=2))
