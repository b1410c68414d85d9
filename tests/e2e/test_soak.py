"""The fault-injection soak's fast variant (benchmarks/soak.py): of its four runs of train_async.py on a tiny random
model (seed 0, one per target: driver, training worker, engine, rollout executor), the suite runs the driver's, killed
mid-save; it resumes from its checkpoint until it finishes. Real Ray, real
engine, real SIGKILLs; the only double is the training worker's pause after writing its checkpoint part
(benchmarks/soak_doubles.py), which holds each save open long enough for a kill to land inside it.

The other three (the training worker's mid-save kill, the executor's and the engine's timed kills) run in the
benchmark, ``python -m benchmarks.run --only soak``: the suite's time budget (docs/testing.md) took them out on
2026-12-06, about 130 s. A killed engine
and a dead rollout executor are still the suite's in tests/e2e/test_fault_tolerance.py and
test_trainer_fault_tolerance.py, and a resume's exactness in every run here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.soak import Settings, soak
from benchmarks.soak_checks import TARGETS, plan_runs
from tests import ray_cluster

SEED = 0
# Half the benchmark's run, still 2.5 epochs (8 prompts, 4 a rollout, 5 rollouts): the last epoch is cut short, so
# every epoch before it must be complete; kills land after steps 0-3, mid-save or timed.
SETTINGS = Settings(num_rollout=5, num_prompts=8, attempt_timeout=420)
# The driver's mid-save kill: the whole run dies with a checkpoint half written (the training worker's, the other
# mid-save kill, left the suite for its time budget on 2026-12-06, as the timed kills did before).
SUITE_RUNS = [
    p.run
    for p in plan_runs(SEED, len(TARGETS), SETTINGS.num_rollout)
    if p.moment == "mid-save" and p.target == "driver"
]


def test_the_fast_plan_kills_every_target_once_and_saves_midway():
    plans = plan_runs(SEED, len(TARGETS), SETTINGS.num_rollout)
    assert sorted(p.target for p in plans) == sorted(TARGETS)
    assert sum(p.moment == "mid-save" for p in plans) == 2
    assert {p.mode for p in plans} == {"one-step-off", "fully-async"}


@pytest.mark.parametrize("run", SUITE_RUNS)
def test_a_killed_run_resumes_and_trains_every_prompt_once(run, tmp_path):
    # Each attempt joins the session's Ray cluster, as every other run in these tests (tests/ray_cluster.py).
    on_shared_cluster = replace(SETTINGS, extra_args=("--ray-address", ray_cluster.address()))
    (r,) = soak(len(TARGETS), SEED, tmp_path, on_shared_cluster, only=[run])
    failures = [
        *(["the kill never fired"] if r["kill"] is None else []),
        *(
            ["the mid-save kill found no save in progress"]
            if r["plan"]["moment"] == "mid-save" and r["kill"] and not r["kill"]["in_save"]
            else []
        ),
        *(["an attempt hung"] if r["hang"] else []),
        *(["no resume followed the kill"] if len(r["attempts"]) < 2 else []),
        *r["exact_problems"],  # every rollout and every prompt of each epoch trained exactly once
        *r["pointer_problems"],  # the pointer only ever named complete checkpoints
        *([] if r["finished"] else ["metrics.jsonl never reached --num-rollout"]),
        *[f"left running: {p}" for p in r["left_running"]],  # no process of any attempt outlived it
        *r["crashed"],  # no attempt failed but by the kill
    ]
    assert failures == [], "\n".join(failures) + "\n" + json.dumps(r["attempts"], indent=1)
    assert r["ok"]
