"""The trainer fault-tolerance policy (``ray/trainer_recovery.py``): whether a dead training worker ends the run,
the restart budget, and which checkpoint the trainers and the data source are restored from; and its flag."""

from __future__ import annotations

import pytest

from miles_async.ray.trainer_recovery import RestorePoint, TrainerDied, TrainerFailed, TrainerRecovery

DEATH = TrainerDied("actor", 1, 4242, "10.0.0.7", "The actor died unexpectedly before finishing this task.")


def test_the_death_names_the_worker():
    assert str(DEATH) == (
        "training worker actor rank 1 (pid 4242, node 10.0.0.7) died: "
        "The actor died unexpectedly before finishing this task"
    )


def test_without_fault_tolerance_a_death_ends_the_run_naming_the_worker():
    recovery = TrainerRecovery(None, "/ckpt")
    with pytest.raises(TrainerFailed, match=r"actor rank 1 \(pid 4242, node 10.0.0.7\).*--use-fault-tolerance"):
        recovery.on_death(DEATH, latest_saved=3)
    assert recovery.restarts == 0


def test_restarts_restore_the_last_checkpoint_until_the_budget_is_spent():
    recovery = TrainerRecovery(2, "/ckpt")
    assert recovery.on_death(DEATH, latest_saved=None) == RestorePoint()  # nothing saved yet: the initial model
    assert RestorePoint().start == 0
    point = recovery.on_death(DEATH, latest_saved=5)
    assert point == RestorePoint("/ckpt", 5) and point.start == 6
    assert recovery.restarts == 2
    with pytest.raises(TrainerFailed, match=r"2 trainer restart\(s\) already used of --max-trainer-restarts 2"):
        recovery.on_death(DEATH, latest_saved=7)
    assert recovery.restarts == 2


def test_zero_restarts_fails_at_the_first_death():
    with pytest.raises(TrainerFailed, match=r"0 trainer restart\(s\) already used of --max-trainer-restarts 0"):
        TrainerRecovery(0, "/ckpt").on_death(DEATH, latest_saved=1)


def test_a_resumed_run_restores_its_own_start_until_it_saved_past_it():
    started = RestorePoint("/old", 9)  # --load /old at checkpoint 9: the run trains from rollout 10
    recovery = TrainerRecovery(5, "/ckpt", started)
    assert recovery.on_death(DEATH, latest_saved=None) == started  # no --save checkpoint yet
    # A --save folder whose pointer is behind the run's start holds an earlier run's iterations.
    assert recovery.on_death(DEATH, latest_saved=4) == started
    assert recovery.on_death(DEATH, latest_saved=11) == RestorePoint("/ckpt", 11)
    # Without --save nothing newer is ever written.
    assert TrainerRecovery(5, None, started).on_death(DEATH, latest_saved=None) == started


def test_max_trainer_restarts_flag(tmp_path):
    from miles_async.arguments import ConfigError, parse_args
    from tests.flag_helpers import minimal_flags

    base = [*minimal_flags(tmp_path, n_prompts=8), "--num-rollout", "2"]
    assert parse_args(base).cluster.max_trainer_restarts is None  # off: a dead trainer ends the run
    assert parse_args([*base, "--use-fault-tolerance"]).cluster.max_trainer_restarts == 3
    assert parse_args([*base, "--use-fault-tolerance", "--max-trainer-restarts", "0"]).cluster.max_trainer_restarts == 0
    cfg = parse_args([*base, "--max-trainer-restarts", "5"])
    assert cfg.cluster.max_trainer_restarts is None
    assert "--max-trainer-restarts 5 is ignored: it only takes effect with --use-fault-tolerance" in cfg.warnings, (
        cfg.warnings
    )
    with pytest.raises(ConfigError, match="--max-trainer-restarts must be >= 0"):
        parse_args([*base, "--use-fault-tolerance", "--max-trainer-restarts", "-1"])
