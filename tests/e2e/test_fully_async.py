"""--fully-async end to end on a tiny model: staleness bounded, filtering never hangs, failures surface."""

from __future__ import annotations

import os
import time

import pytest

from miles_async.inference.embedded.server import ENGINE_CLASS_ENV
from tests.e2e.runner import (
    all_pids,
    run_train,
    tiny_args,
    wait_all_dead,
    without_rm_type,
)

ASYNC = [
    "--fully-async",
    "--use-tis",
    "--custom-rm-path",
    "tests.e2e.rewards:starts_with_digit",
    "--rollout-max-response-len",
    "2",
    "--lr",
    "1e-2",
]


@pytest.mark.parametrize("staleness", [0, 2])
def test_staleness_is_bounded_by_recorded_versions(staleness, tiny_model, tiny_task, tmp_path):
    run = run_train(
        without_rm_type(
            tiny_args(
                tiny_model, tiny_task, tmp_path, "--num-rollout", "8", "--max-staleness-steps", str(staleness), *ASYNC
            )
        ),
        tmp_path,
    )
    assert run.returncode == 0, run.output[-3000:]
    m = run.metrics
    assert len(m) == 8
    assert max(r["async/staleness_max"] for r in m) <= staleness
    if staleness:  # the producer really ran ahead of the trainer
        assert max(r["async/staleness_max"] for r in m) >= 1
    assert all(r["rollout/num_samples"] == 32 for r in m)
    assert wait_all_dead(all_pids(run.processes())) == []


def test_zero_variance_filter_keeps_pulling_and_never_hangs(tiny_model, tiny_task, tmp_path):
    # A reward that is 0 for every sample would drop every group; this one drops many groups.
    run = run_train(
        without_rm_type(
            tiny_args(
                tiny_model,
                tiny_task,
                tmp_path,
                "--num-rollout",
                "6",
                "--zero-variance-filter",
                "--n-samples-per-prompt",
                "2",
                *ASYNC,
            )
        ),
        tmp_path,
    )
    assert run.returncode == 0, run.output[-3000:]
    m = run.metrics
    assert len(m) == 6
    assert m[-1]["async/groups_dropped"] > 0
    assert all(r["rollout/zero_variance_group_frac"] == 0 for r in m)


def test_producer_failure_surfaces_fast(tiny_model, tiny_task, tmp_path):
    marker = tmp_path / "count"
    os.environ["MILES_ASYNC_TEST_MARKER"] = str(marker)
    try:
        args = tiny_args(tiny_model, tiny_task, tmp_path, "--num-rollout", "50", *ASYNC)
        args = without_rm_type(args)
        args[args.index("tests.e2e.rewards:starts_with_digit")] = "tests.e2e.rewards:fails_on_third_rollout"
        run = run_train(args, tmp_path)
        exited = time.time()
    finally:
        del os.environ["MILES_ASYNC_TEST_MARKER"]
    assert run.returncode != 0
    assert "induced reward failure" in run.output and "producer" in run.output
    assert len(run.metrics) < 50
    raised = float((tmp_path / "count.raised").read_text())
    assert exited - raised < 10, exited - raised  # error surfaced and everything shut down within 10 s
    assert wait_all_dead(all_pids(run.processes())) == []


def test_long_tail_with_aborts_resumes_partial_samples_within_the_bound(tiny_model, tiny_task, tmp_path):
    """Heavy-tailed lengths, weight updates that abort in-flight requests: partial samples resume and are
    trained, and no trained token is older than the staleness bound (from the recorded versions).

    Whether an abort finds a request mid-generation is a race on a fast tiny model, so the engine is a
    double (tests/e2e/engine_doubles.py) that holds one request a token short of its end until an abort:
    the first weight update aborts it, and it resumes and finishes ahead of every newer group."""
    args = without_rm_type(
        tiny_args(
            tiny_model,
            tiny_task,
            tmp_path,
            "--num-rollout",
            "8",
            "--max-staleness-steps",
            "1",
            "--pause-generation-mode",
            "abort",
            "--partial-rollout",
            "--custom-generate-function-path",
            "benchmarks.workloads:long_tail_generate",
            *ASYNC,
            "--rollout-max-response-len",
            "128",
        )
    )  # the last value wins
    run = run_train(args, tmp_path, extra_env={ENGINE_CLASS_ENV: "tests.e2e.engine_doubles:HoldOneRequestUntilAbort"})
    assert run.returncode == 0, run.output[-3000:]
    m = run.metrics
    assert max(r["async/staleness_max"] for r in m) <= 1
    assert sum(r["rollout/partial_resumed_samples"] for r in m) > 0
    assert m[1]["rollout/partial_resumed_samples"] >= 1  # the held request, trained the step after its abort
    assert max(r["rollout/response_len_max"] for r in m) > 32  # the tail was really there


def test_watchdog_warns_when_no_group_finishes(tiny_model, tiny_task, tmp_path):
    os.environ["MILES_ASYNC_TEST_MARKER"] = str(tmp_path / "stalled")
    try:
        run = run_train(
            without_rm_type(
                tiny_args(
                    tiny_model,
                    tiny_task,
                    tmp_path,
                    "--num-rollout",
                    "2",
                    "--rollout-batch-size",
                    "1",
                    "--n-samples-per-prompt",
                    "2",
                    "--max-staleness-steps",
                    "0",
                    "--rollout-watchdog-seconds",
                    "1",
                    "--custom-generate-function-path",
                    "tests.e2e.rewards:stall_once",
                    *ASYNC,
                )
            ),
            tmp_path,
        )
    finally:
        del os.environ["MILES_ASYNC_TEST_MARKER"]
    assert run.returncode == 0, run.output[-3000:]
    assert "watchdog: no group finished" in run.output
