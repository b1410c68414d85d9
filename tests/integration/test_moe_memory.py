"""The MoE memory projection's count (benchmarks/moe_memory_core.py) against what megatron-core allocates: a tiny
Qwen3-MoE trains one step at TP 2 x EP 2 (expert TP 1, sequence parallelism, the distributed optimizer) over gloo,
and each rank's parameters, DDP gradient buffers and Adam state add up to the count from config.json within Megatron's
buffer padding. A count that put the experts, the router or the optimizer's shards on the wrong ranks fails."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe_memory_core as core
from benchmarks import train_memory_moe

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -r requirements-megatron.txt)")


def test_the_count_is_what_megatron_allocates_at_tp2_ep2(tmp_path):
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    model = make_tiny_model(tmp_path / "model", seed=2, arch="qwen3_moe")
    data, _ = make_tiny_task_dataset(tmp_path / "task", n_train=8, n_eval=2)
    name = "TP2 x EP2, expert TP 1"
    ranks = train_memory_moe.measure(model, data, (name,), tmp_path)[name]
    shape = core.MoEShape.of(json.loads((model / "config.json").read_text()))
    counted = core.rank_bytes(shape, core.Layout(2, 1, 2, 1, 4), core.Precision.fp32(distributed_optimizer=True))
    assert len(ranks) == 4
    for r in ranks:
        # Parameters exactly; DDP's gradient buffer and the optimizer's shards are padded for alignment.
        assert r["params"] == counted.params
        assert counted.grads <= r["grads"] <= counted.grads * 1.01
        assert counted.optimizer * 0.99 <= r["optimizer"] <= counted.optimizer * 1.01
