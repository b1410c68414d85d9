"""The placement plan's fit check (config/placement.unplaceable): what a Ray cluster can never hold is refused
before anything waits on it, naming the flags that size the group; what fits passes."""

from __future__ import annotations

from miles_async.config.placement import WorkerGroup, unplaceable


def _plan(actor: int, engines: int, gpus_per_engine: int) -> tuple[WorkerGroup, ...]:
    return (
        WorkerGroup("actor", actor, 1, "megatron", "--actor-num-nodes x --actor-num-gpus-per-node"),
        WorkerGroup(
            "rollout", engines, gpus_per_engine, "sglang", "--rollout-num-gpus / --rollout-num-gpus-per-engine"
        ),
    )


def test_an_engine_wider_than_every_node_is_refused_naming_the_flag():
    problem = unplaceable(_plan(actor=4, engines=1, gpus_per_engine=16), [8, 8, 8])
    assert problem is not None
    assert "an engine needs 16 GPUs on one node" in problem
    assert "--rollout-num-gpus-per-engine" in problem and "largest node of the Ray cluster has 8" in problem


def test_too_few_gpus_in_all_are_refused_with_the_count_of_each_group():
    problem = unplaceable(_plan(actor=8, engines=4, gpus_per_engine=2), [8])
    assert problem is not None
    assert "needs 16 GPUs (actor 8, rollout 8" in problem and "has 8" in problem


def test_enough_gpus_in_all_but_split_badly_over_nodes_is_refused():
    # 7 GPUs wanted and 7 there, but each node of 3 holds one engine of 2, and the node of 1 none.
    problem = unplaceable(_plan(actor=1, engines=3, gpus_per_engine=2), [3, 3, 1])
    assert problem is not None and "do not fit" in problem


def test_plans_that_fit_pass():
    assert unplaceable(_plan(actor=4, engines=2, gpus_per_engine=2), [8]) is None
    assert unplaceable(_plan(actor=2, engines=2, gpus_per_engine=1), [2, 2, 2]) is None  # the rehearsal cluster
    assert unplaceable(_plan(actor=16, engines=4, gpus_per_engine=4), [8, 8, 8, 8]) is None
