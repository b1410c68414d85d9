"""DAPO dynamic sampling end to end on a tiny model, in the one-step-off loop and with --fully-async.

The reward (tests.e2e.rewards:flat_on_odd_label) gives every sample of a prompt with an odd label the same
reward, so the filter must drop exactly those groups; the data has 12 prompts and each run trains more groups
than one epoch holds, so every run crosses an epoch boundary. The filter is a Miles-style one loaded by
dotted path (tests.e2e.rewards:nonzero_std).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from miles_async.utils.checkpoint import iteration_dir
from tests.e2e.runner import Run, all_pids, run_train, tiny_args, wait_all_dead, without_rm_type

BATCH, N_PROMPTS, N_ROLLOUT = 2, 12, 6
FILTER = "tests.e2e.rewards:nonzero_std"


def _small_task(tiny_task, tmp_path: Path) -> tuple[Path, Path]:
    train, held_out = tiny_task
    small = tmp_path / "train12.jsonl"
    small.write_text("".join(train.read_text().splitlines(keepends=True)[:N_PROMPTS]))
    return small, held_out


def _run(tiny_model, tiny_task, tmp_path: Path, out: str, *extra: str) -> tuple[Run, dict[str, str]]:
    task = _small_task(tiny_task, tmp_path)
    labels = {r["uid"]: r["label"] for r in map(json.loads, task[0].read_text().splitlines())}
    args = without_rm_type(
        tiny_args(
            tiny_model,
            task,
            tmp_path / out,
            "--custom-rm-path",
            "tests.e2e.rewards:flat_on_odd_label",
            "--dynamic-sampling-filter-path",
            FILTER,
            "--rollout-batch-size",
            str(BATCH),
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "2",
            "--num-rollout",
            str(N_ROLLOUT),
            "--save",
            str(tmp_path / "ckpt"),
            *extra,
        )
    )
    run = run_train(args, tmp_path / out, timeout=240)
    assert run.returncode == 0, run.output[-3000:]
    return run, labels


def _check(runs: list[Run], labels: dict[str, str]) -> list[tuple[int, str]]:
    """The properties both loops promise over a run and its resumptions; returns the (epoch, uid) of every prompt
    consumed."""
    # A resumed run repeats the steps after its checkpoint: the last row of a step, the last record of a rollout
    # is what the final model went through.
    metrics = sorted({m["step"]: m for run in runs for m in run.metrics}.values(), key=lambda m: m["step"])
    rollouts = {r["rollout_id"]: r for run in runs for r in run.rollouts}
    assert [m["step"] for m in metrics] == list(range(1, N_ROLLOUT + 1))
    assert sorted(rollouts) == list(range(N_ROLLOUT))
    consumed, total_dropped = [], 0
    for step, m in enumerate(metrics):
        r = rollouts[step]
        assert len(r["uids"]) == BATCH and m["rollout/groups_kept"] == BATCH  # a full batch of kept groups
        assert all(len(set(rw)) > 1 for rw in r["rewards"])  # none kept has zero variance
        assert all(int(labels[u]) % 2 == 0 for u in r["uids"])
        assert all(len(set(rw)) == 1 for rw in r["dropped_rewards"])  # only zero-variance groups dropped
        assert all(int(labels[u]) % 2 == 1 for u in r["dropped_uids"])
        assert m["rollout/groups_dropped"] == len(r["dropped_uids"])  # metrics.jsonl matches rollouts.jsonl
        total_dropped += len(r["dropped_uids"])
        assert m["rollout/groups_dropped_total"] == total_dropped
        assert m["rollout/groups_kept_total"] == BATCH * (step + 1)
        assert None not in r["epochs"] and None not in r["dropped_epochs"]
        consumed += [*zip(r["epochs"], r["uids"]), *zip(r["dropped_epochs"], r["dropped_uids"])]
    assert total_dropped > 0
    repeated = [k for k, c in Counter(consumed).items() if c > 1]
    assert repeated == [], f"trained or filtered twice in one epoch: {repeated}"
    assert max(e for e, _ in consumed) >= 1  # the run crossed an epoch boundary
    for run in runs:
        assert wait_all_dead(all_pids(run.processes())) == []
    return consumed


def test_one_step_off_keeps_full_batches_across_an_epoch_and_a_resume_without_losing_a_prompt(
    tiny_model, tiny_task, tmp_path
):
    # Stopped after 5 steps, then resumed from the latest checkpoint whose data source holds prompts given back
    # (with 6 prompts drawn for 2 kept groups nearly every rollout gives some back): they and the filter's
    # counters must come back with it.
    over = ("--over-sampling-batch-size", "6", "--save-interval", "1")
    first, labels = _run(tiny_model, tiny_task, tmp_path, "a", *over, "--debug-exit-after-rollout", "5")
    states = [json.loads((iteration_dir(tmp_path / "ckpt", i) / "rollout_state.json").read_text()) for i in range(5)]
    with_given_back = [i for i, st in enumerate(states) if st["data_source"].get("given_back")]
    assert with_given_back, [st["data_source"] for st in states]
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(with_given_back[-1]))
    second, _ = _run(tiny_model, tiny_task, tmp_path, "b", *over, "--load", str(tmp_path / "ckpt"))
    assert second.metrics[0]["step"] == with_given_back[-1] + 2
    consumed = _check([first, second], labels)
    # Each epoch the data source has left behind is complete: each prompt was trained or dropped in it, or was
    # given back and is the next to be drawn (the final checkpoint carries those).
    state = json.loads((iteration_dir(tmp_path / "ckpt", N_ROLLOUT - 1) / "rollout_state.json").read_text())
    pending = [(e, u) for e, u in state["data_source"].get("given_back", [])]
    assert not set(pending) & set(consumed)
    assert state["data_source"]["epoch"] >= 1
    for epoch in range(state["data_source"]["epoch"]):
        assert sorted(u for e, u in consumed + pending if e == epoch) == sorted(labels), epoch
    # what the checkpoint resumed from had given back was drawn again after the resume
    assert {(e, u) for e, u in states[with_given_back[-1]]["data_source"]["given_back"]} <= set(consumed + pending)
    assert state["groups_filter_totals"] == [
        second.metrics[-1]["rollout/groups_kept_total"],
        second.metrics[-1]["rollout/groups_dropped_total"],
    ]


def test_fully_async_applies_the_same_filter_path(tiny_model, tiny_task, tmp_path):
    run, labels = _run(tiny_model, tiny_task, tmp_path, "out", "--fully-async", "--max-staleness-steps", "1")
    _check([run], labels)
    assert run.metrics[-1]["async/groups_dropped"] == run.metrics[-1]["rollout/groups_dropped_total"]


def test_one_step_off_fails_naming_a_filter_that_keeps_nothing(tiny_model, tiny_task, tmp_path):
    # Every reward 0: each group is dropped. After a full pass over the 64 prompts the rollout fails, naming the
    # filter, instead of drawing epoch after epoch.
    args = without_rm_type(
        tiny_args(
            tiny_model,
            tiny_task,
            tmp_path,
            "--num-rollout",
            "2",
            "--zero-variance-filter",
            "--custom-rm-path",
            "tests.e2e.rewards:always_zero",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "2",
        )
    )
    run = run_train(args, tmp_path, timeout=240)
    assert run.returncode != 0
    assert re.search(
        r"--zero-variance-filter dropped 64 groups in a row, at least a full pass over the 64 prompts", run.output
    ), run.output[-3000:]
    assert run.metrics == []
    assert wait_all_dead(all_pids(run.processes())) == []
