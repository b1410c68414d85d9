"""A run whose actor is a trainer double (``$MILES_ASYNC_ACTOR_CLASS``): the Ray workers run the class the
benchmarks name, so each step costs what they set."""

from __future__ import annotations

import pytest

from benchmarks.train_doubles import fixed_train_cost_env
from tests.e2e.runner import run_train, tiny_args

pytestmark = pytest.mark.timeout(600)


def test_the_train_workers_run_the_named_double(tiny_model, tiny_task, tmp_path):
    run = run_train(
        tiny_args(tiny_model, tiny_task, tmp_path, "--num-rollout", "2"), tmp_path, extra_env=fixed_train_cost_env(1.5)
    )
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.metrics) == 2
    for m in run.metrics:
        assert 1.5 <= m["train/seconds"] < 5, m  # the double's sleep, not a training step
        assert "train/lr" not in m  # no optimizer ran
