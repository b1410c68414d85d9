"""Pure pieces of the Megatron backend (no process group): layouts, conversion algebra, flags."""

from __future__ import annotations

import re

import pytest
import torch

from miles_async.arguments import ConfigError, parse_args
from miles_async.backends.megatron.convert import hf_shard
from miles_async.backends.megatron.model import ArchSpec
from miles_async.backends.packing import collate
from tests.flag_helpers import minimal_flags


def _arch(vocab_size: int = 10) -> ArchSpec:
    from transformers import LlamaConfig

    return ArchSpec.from_hf(
        LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=2, max_position_embeddings=32,
                    tie_word_embeddings=True)
    )  # fmt: skip


def test_fused_qkv_is_interleaved_by_key_value_group_and_splits_back():
    """mbridge's fused layout, which the shards are cut from: Megatron's own."""
    names = _arch().names
    q = torch.arange(8.0)[:, None].expand(8, 8)  # 4 heads x head_dim 2 -> rows 0..7
    k, v = 100 + torch.arange(4.0)[:, None].expand(4, 8), 200 + torch.arange(4.0)[:, None].expand(4, 8)
    weight = names.lookup(["decoder.layers.0.self_attention.linear_qkv.weight"])
    fused = weight.to_mcore([q, k, v])
    # group 0: q heads 0-1, k head 0, v head 0; group 1: q heads 2-3, k head 1, v head 1
    assert fused[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    for (_, a), b in zip(weight.to_hf(fused), (q, k, v)):
        assert torch.equal(a, b)
    bias = names.lookup(["decoder.layers.0.self_attention.linear_qkv.bias"]).to_mcore([q[:, 0], k[:, 0], v[:, 0]])
    assert torch.equal(bias, fused[:, 0])


def test_tensor_parallel_shards_reassemble_the_fused_weights():
    arch = _arch(vocab_size=9)  # padded to 10 for TP 2
    g = torch.Generator().manual_seed(0)
    hf = {
        "model.embed_tokens.weight": torch.randn(9, 8, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g),
    }
    emb = [hf_shard("embedding.word_embeddings.weight", hf.__getitem__, arch, 2, r) for r in range(2)]
    assert [e.shape[0] for e in emb] == [5, 5] and torch.equal(torch.cat(emb)[:9], hf["model.embed_tokens.weight"])
    assert not torch.cat(emb)[9:].any()
    fc1 = [hf_shard("decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__, arch, 2, r) for r in range(2)]
    # each rank holds [its gate rows; its up rows]
    assert torch.equal(fc1[1][:6], hf["model.layers.0.mlp.gate_proj.weight"][6:])
    assert torch.equal(fc1[1][6:], hf["model.layers.0.mlp.up_proj.weight"][6:])
    proj = [
        hf_shard("decoder.layers.0.self_attention.linear_proj.weight", hf.__getitem__, arch, 2, r) for r in range(2)
    ]
    assert torch.equal(torch.cat(proj, dim=1), hf["model.layers.0.self_attn.o_proj.weight"])


def test_megatron_layout_right_aligns_rows_and_points_at_the_predicting_positions():
    from miles_async.backends.megatron.actor import megatron_layout

    mb = collate([[5, 6, 7], [8]], [[9, 10], [11, 12]], [[1, 1], [1, 1]], pad_id=0)
    ids, pos, targets = megatron_layout(mb, pad_id=0, multiple=4)
    assert ids.tolist() == [[5, 6, 7, 9, 10, 0, 0, 0], [8, 11, 12, 0, 0, 0, 0, 0]]
    assert pos[1].tolist() == list(range(8))
    # logits at position t predict token t + 1
    assert targets.tolist() == [[2, 3], [0, 1]]
    assert all(ids[i, targets[i] + 1].tolist() == mb.response_ids[i].tolist() for i in range(2))


def test_arch_spec_reads_hf_configs_and_refuses_what_it_cannot_map():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    q3 = ArchSpec.from_hf(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32
    q2 = ArchSpec.from_hf(Qwen2Config(rope_theta=1e6))
    assert q2.qkv_bias and q2.rope_theta == 1e6
    llama31 = ArchSpec.from_hf(
        LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert llama31.rope_scaling_factor == 8.0
    with pytest.raises(ValueError, match="hidden_act"):
        ArchSpec.from_hf(LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        ArchSpec.from_hf(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.fixture
def setup(tmp_path):
    return [*minimal_flags(tmp_path, num_hidden_layers=2), "--n-samples-per-prompt", "2", "--num-rollout", "3"]


def test_megatron_flags_build_the_parallel_layout(setup):
    cfg = parse_args(
        setup
        + [
            "--train-backend",
            "megatron",
            "--actor-num-gpus-per-node",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ]
    )
    m = cfg.train.megatron
    assert (m.tensor_model_parallel_size, m.model_parallel_size, m.use_distributed_optimizer) == (2, 2, True)
    assert cfg.cluster.num_train_workers == 4
    assert parse_args(setup).train.megatron.model_parallel_size == 1
    pp = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2"]
    m = parse_args(setup + pp + ["--decoder-last-pipeline-num-layers", "1"]).train.megatron
    assert (m.pipeline_model_parallel_size, m.model_parallel_size, m.decoder_last_pipeline_num_layers) == (2, 2, 1)


_PP2 = ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--train-backend", "fsdp", "--tensor-model-parallel-size", "2"], "need --train-backend megatron"),
        (
            ["--train-backend", "megatron", "--tensor-model-parallel-size", "4", "--actor-num-gpus-per-node", "4"],
            "must divide the model's 4 attention heads and 2 key/value heads",
        ),
        (["--train-backend", "megatron", "--tensor-model-parallel-size", "2"], "do not split into TP 2"),
        (
            ["--train-backend", "megatron", "--pipeline-model-parallel-size", "4", "--actor-num-gpus-per-node", "4"],
            "--pipeline-model-parallel-size 4 does not split the 2 layers",
        ),
        (
            [*_PP2, "--decoder-first-pipeline-num-layers", "2"],
            "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 does not split the 2 layers",
        ),
        (
            [*_PP2, "--num-layers-per-virtual-pipeline-stage", "1"],
            "the interleaved (virtual pipeline) schedule is not supported",
        ),
        (
            ["--train-backend", "fsdp", "--pipeline-model-parallel-size", "2"],
            "--pipeline-model-parallel-size 2 is not supported by the fsdp",
        ),
        (["--train-backend", "megatron", "--advantage-estimator", "ppo"], "needs a critic"),
        (["--train-backend", "megatron", "--keep-old-actor"], "--keep-old-actor is not supported by the megatron"),
        (
            ["--train-backend", "megatron", "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "2"],
            "must split evenly over 3 data-parallel",
        ),
    ],
)
def test_megatron_flags_are_validated(setup, extra, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse_args(setup + extra)


def test_context_parallelism_needs_transformer_engine_and_under_check_config_says_so_as_a_warning(setup):
    """CP's data path is the backend's (tests/integration/test_context_parallel.py); its attention is Transformer
    Engine's. Without it (as on this CPU) a run stops at start naming it, and --check-config, which a launcher for
    a GPU cluster passes on a laptop, warns instead."""
    from miles_async.config.declare import module_installed

    if module_installed("transformer_engine"):
        pytest.skip("Transformer Engine is installed: CP is accepted (scripts/gpu/check_context_parallel.py)")
    argv = ["--train-backend", "megatron", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    with pytest.raises(ConfigError, match=re.escape("--context-parallel-size 2 needs Transformer Engine")):
        parse_args(setup + argv)
    cfg = parse_args(setup + argv + ["--check-config"])
    assert cfg.train.megatron.context_parallel_size == 2
    assert any("--context-parallel-size 2 needs Transformer Engine" in w for w in cfg.warnings), cfg.warnings


def test_a_distributed_optimizer_checkpoint_resumes_only_into_its_layout(tmp_path):
    """megatron_meta.json's layout against the run's: the distributed optimizer's state (its dp_reshardable buffer
    shards) loads into another data parallelism only; a PP 2 checkpoint loaded into PP 1 otherwise fails deep in
    torch.distributed.checkpoint ('Global shape mismatch ... bucket_idx_0.param'). The plain optimizer's state and
    a checkpoint of weights alone reshard to any layout."""
    from miles_async.backends.megatron.actor import check_optimizer_layout

    meta = {"has_optimizer": True, "tp": 1, "pp": 2, "ep": 1, "dp": 1, "distributed_optimizer": True}
    one = {"tp": 1, "pp": 1, "ep": 1}
    with pytest.raises(RuntimeError, match=re.escape("resume with --pipeline-model-parallel-size 2 (this run: 1)")):
        check_optimizer_layout(meta, one, True, tmp_path)
    check_optimizer_layout({**meta, "dp": 2}, {"tp": 1, "pp": 2, "ep": 1}, True, tmp_path)
    check_optimizer_layout({**meta, "distributed_optimizer": False}, one, False, tmp_path)
    check_optimizer_layout({**meta, "has_optimizer": False}, one, True, tmp_path)
    with pytest.raises(RuntimeError, match="saved with --use-distributed-optimizer"):
        check_optimizer_layout(meta, {"tp": 1, "pp": 2, "ep": 1}, False, tmp_path)


def test_megatron_refuses_a_vision_language_checkpoint_by_name(tmp_path):
    """Without --multimodal-keys (which the capability table refuses) a VLM's text side would start building and fail
    deep in the bridge; the parser names the checkpoint and the backend that trains it."""
    flags = [*minimal_flags(tmp_path, model_type="qwen2_5_vl", vision_config={"depth": 1}), "--num-rollout", "1"]
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'model'} is a vision-language model (model_type")):
        parse_args([*flags, "--train-backend", "megatron"])
    assert parse_args(flags).train.backend == "fsdp"
