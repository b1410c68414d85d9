"""The trainer's plugin point for doubles: ``$MILES_ASYNC_ACTOR_CLASS`` names the policy worker a run uses,
and the benchmarks' ``FixedTrainCost`` turns a training step into a set sleep, weights untouched."""

from __future__ import annotations

import pytest

from benchmarks.train_doubles import (
    TRAIN_SECONDS_ENV,
    FixedTrainCost,
    fixed_train_cost_env,
)
from miles_async.arguments import parse_args
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.backends.fsdp.critic import FSDPCritic
from miles_async.ray.train_group import ACTOR_CLASS_ENV, worker_class
from miles_async.utils.plugins import PluginError


@pytest.fixture
def cfg(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    return parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "2",
            "--rm-type",
            "first_integer",
            "--advantage-estimator",
            "ppo",
            "--use-tis",
            "--num-rollout",
            "1",
            "--output-dir",
            str(tmp_path),
        ]
    )


def test_the_actor_class_variable_picks_a_subclass_of_the_backends_worker(cfg, monkeypatch):
    assert worker_class(cfg.train) is FSDPTrainActor
    monkeypatch.setenv(ACTOR_CLASS_ENV, f"{FixedTrainCost.__module__}:FixedTrainCost")
    assert worker_class(cfg.train) is FixedTrainCost
    assert worker_class(cfg.critic) is FSDPCritic  # the actor's double only
    monkeypatch.setenv(ACTOR_CLASS_ENV, "miles_async.backends.fsdp.critic:FSDPCritic")
    with pytest.raises(
        PluginError,
        match=r"\$MILES_ASYNC_ACTOR_CLASS: .*FSDPCritic.* is not a subclass of "
        r"miles_async\.backends\.fsdp\.actor\.FSDPTrainActor",
    ):
        worker_class(cfg.train)


def test_a_fixed_train_cost_sleeps_its_seconds_and_leaves_the_weights(cfg, monkeypatch):
    for key, value in fixed_train_cost_env(0.4).items():
        monkeypatch.setenv(key, value)
    actor = FixedTrainCost(cfg.train, rank=0, world_size=1, total_optimizer_steps=1)
    before = actor.state_checksum()
    metrics = actor.train(0, {})
    assert 0.4 <= metrics["train/seconds"] < 2, metrics
    assert metrics["train/finished_at"] - metrics["train/started_at"] == pytest.approx(
        metrics["train/seconds"], abs=0.05
    )
    assert actor.state_checksum() == before and "train/lr" not in metrics  # no optimizer step
    monkeypatch.delenv(TRAIN_SECONDS_ENV)
    with pytest.raises(ValueError, match=r"\$MILES_ASYNC_TRAIN_SECONDS"):
        FixedTrainCost(cfg.train, rank=0, world_size=1, total_optimizer_steps=1)
