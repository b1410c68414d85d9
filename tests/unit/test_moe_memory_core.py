"""benchmarks/moe_memory_core.py, the count behind the MoE memory projection, against hand counts: Qwen3-30B-A3B's
size, where each parameter of a layer lands under TP, PP and EP, what the distributed optimizer and CPU offload take
off a GPU, the layouts megatron-core refuses, and the rule that picks one. (The count against the tensors megatron-core
allocates: tests/integration/test_moe_memory.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import moe_memory_core as core

QWEN3_30B_A3B = json.loads(
    (Path(__file__).parents[1] / "scripts" / "model_configs" / "Qwen3-30B-A3B" / "config.json").read_text()
)
TINY = dict(vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=2, num_experts=4, moe_intermediate_size=3, intermediate_size=5, model_type="qwen3_moe",
            tie_word_embeddings=False)  # fmt: skip


def test_qwen3_30b_a3b_counts_to_its_published_size():
    shape = core.MoEShape.of(QWEN3_30B_A3B)
    assert round(shape.total / 1e9, 1) == 30.5  # Qwen's model card
    assert core.stage_params(shape, core.Layout(1, 1, 1), 0).expert == 48 * 128 * 3 * 2048 * 768


def test_each_parameter_lands_where_megatron_puts_it():
    shape = core.MoEShape.of(TINY)
    # per layer: q/k/v 3 x (2 heads x 2) x 4 in, o 4 x 4, norms 2 x 4 and q/k norms 2 x 2, router 4 x 4;
    # experts 4 x (gate, up, down) 3 x 4 x 3
    attention, norms, router, expert = 3 * 4 * 4 + 4 * 4, 8 + 4, 16, 3 * 4 * 3
    embed = head = 10 * 4
    one = core.stage_params(shape, core.Layout(1, 1, 1), 0)
    assert one == core.StageParams(embed + head + 4 + 2 * (attention + norms + router), 2 * 4 * expert)
    # TP 2: attention and the vocabulary (padded 10 -> 10) halved, norms and router whole; experts over expert TP
    tp2 = core.stage_params(shape, core.Layout(2, 1, 1, 2), 0)
    assert tp2 == core.StageParams((embed + head) // 2 + 4 + 2 * (attention // 2 + norms + router), 4 * expert)
    # PP 2: the embedding on the first stage, the final norm and head on the last, one layer each
    first, last = (core.stage_params(shape, core.Layout(1, 2, 1), s) for s in (0, 1))
    assert first == core.StageParams(embed + attention + norms + router, 4 * expert)
    assert last == core.StageParams(head + 4 + attention + norms + router, 4 * expert)
    # EP 2: half the experts of each layer
    assert core.stage_params(shape, core.Layout(1, 1, 2, 1, 2), 0).expert == 2 * 2 * expert
    # tied embeddings: one tensor on one stage, a copy for the head on the last of two
    tied = core.MoEShape.of({**TINY, "tie_word_embeddings": True})
    assert core.stage_params(tied, core.Layout(1, 1, 1), 0).dense == one.dense - head
    assert core.stage_params(tied, core.Layout(1, 2, 1), 1).dense == last.dense


def test_the_distributed_optimizer_shards_dense_state_over_dp_and_experts_over_expert_dp_and_offload_frees_it():
    shape = core.MoEShape.of(TINY)
    layout = core.Layout(1, 1, 2, 1, 4)  # DP 4, EP 2: expert data parallel 2
    p = core.stage_params(shape, layout, 0)
    sharded = core.rank_bytes(shape, layout, core.Precision.fp32(distributed_optimizer=True))
    whole = core.rank_bytes(shape, layout, core.Precision.fp32(distributed_optimizer=False))
    assert sharded.optimizer == 8 * (-(-p.dense // 4) + -(-p.expert // 2))
    assert whole.optimizer == 8 * (p.dense + p.expert)
    assert sharded.params == whole.params == 4 * (p.dense + p.expert)
    bf16 = core.rank_bytes(shape, layout, core.Precision.bf16())
    assert (bf16.params, bf16.grads) == (2 * (p.dense + p.expert), 4 * (p.dense + p.expert))
    offloaded = core.rank_bytes(shape, layout, core.Precision.bf16(optimizer_on_host=True))
    assert offloaded.total == bf16.total - bf16.optimizer


def test_layouts_megatron_refuses_are_named_and_never_proposed():
    shape = core.MoEShape.of(QWEN3_30B_A3B)
    assert core.problems(shape, core.Layout(8, 1, 1, 1, 8)) == ["4 KV heads do not split over TP 8"]
    assert "48 layers do not split into 5 even stages" in core.problems(shape, core.Layout(1, 5, 1, 1, 5))
    assert core.problems(shape, core.Layout(1, 1, 3, 1, 3)) == ["128 experts do not split over EP 3"]
    assert core.problems(shape, core.Layout(4, 1, 8, 1, 8)) == []  # the launcher's
    proposed = list(core.layouts(shape, 16))
    assert core.Layout(4, 1, 8, 1, 16) in proposed and all(not core.problems(shape, lay) for lay in proposed)
    assert not any(lay.tp == 8 for lay in proposed)


def test_the_chosen_layout_fits_with_the_fewest_model_parallel_ranks_then_the_smallest_ep():
    shape = core.MoEShape.of(QWEN3_30B_A3B)
    precision = core.Precision.bf16()
    # 18 bytes per parameter of state over 8 GPUs is ~69 GB: nothing fits 48 GB per GPU on one node
    assert core.choose(shape, 8, precision, 48e9) is None
    chosen = core.choose(shape, 16, precision, 48e9)
    assert chosen is not None and core.rank_bytes(shape, chosen, precision).total <= 48e9
    fits = [lay for lay in core.layouts(shape, 16) if core.rank_bytes(shape, lay, precision).total <= 48e9]
    assert chosen.tp * chosen.pp == min(lay.tp * lay.pp for lay in fits)
    assert chosen.ep == min(lay.ep for lay in fits if lay.tp * lay.pp == chosen.tp * chosen.pp)
