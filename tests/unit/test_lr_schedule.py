"""The learning-rate schedule (backends/worker.lr_lambda) and --lr-decay-iters, Megatron's fixed decay span."""

import dataclasses

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.backends.worker import lr_lambda
from miles_async.config.train import OptimizerConfig
from tests.flag_helpers import minimal_flags

COSINE = OptimizerConfig("adam", 1e-5, 1e-6, 0, "cosine", 0.0, 0.9, 0.98, 1e-8, 1.0)


def test_without_a_span_the_decay_spans_the_run():
    f = lr_lambda(COSINE, total_steps=30)
    assert f(0) == 1.0 and f(15) == pytest.approx(0.55) and f(30) == pytest.approx(0.1) and f(45) == pytest.approx(0.1)


def test_a_fixed_span_keeps_a_shorter_run_on_the_longer_runs_schedule_then_holds_min_lr():
    long_run = lr_lambda(COSINE, total_steps=60)
    spanned = lr_lambda(dataclasses.replace(COSINE, lr_decay_iters=60), total_steps=30)
    assert [spanned(s) for s in range(30)] == [long_run(s) for s in range(30)]
    assert spanned(15) != lr_lambda(COSINE, total_steps=30)(15)
    short_span = lr_lambda(dataclasses.replace(COSINE, lr_decay_iters=10), total_steps=30)
    assert short_span(10) == short_span(29) == pytest.approx(0.1)  # --min-lr / --lr from the span's end on


def test_the_flag_reaches_the_optimizer_config_and_a_bad_value_is_refused_by_name(tmp_path):
    flags = [*minimal_flags(tmp_path), "--num-rollout", "2"]
    cfg = parse_args([*flags, "--lr-decay-style", "cosine", "--lr-decay-iters", "60"])
    assert cfg.train.optimizer.lr_decay_iters == 60
    assert parse_args(flags).train.optimizer.lr_decay_iters is None
    with pytest.raises(ConfigError, match="--lr-decay-iters"):
        parse_args([*flags, "--lr-decay-style", "cosine", "--lr-decay-iters", "0"])
