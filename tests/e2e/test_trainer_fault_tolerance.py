"""A training worker SIGKILLed mid-run (two workers: the other rank may be blocked in a gloo collective with it).

Without --use-fault-tolerance the run ends within 60 s of the kill, whatever the driver awaited then, with a
message naming the worker, and no process outlives it. With it, the trainers and the rollout side are restored
from the last checkpoint and the run finishes, each prompt of the epoch trained exactly once, the engines never
restarted and serving the trainer's weights. Real Ray, real engines, a tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from benchmarks.engine_doubles import fixed_step_cost_env
from tests.e2e.runner import ENGINE_AUTH, Run, all_pids, start_train, tiny_args, wait_all_dead
from tests.e2e.trainer_doubles import stall_env

TWO_WORKERS = ["--actor-num-gpus-per-node", "2"]
# From the kill to the driver's exit: Ray reports the death within about a second, the driver's liveness watch
# pings each worker every second, and taking the run down is bounded.
EXIT_BOUND = 60.0


def _kill_and_wait(args: list[str], env: dict, out_dir: Path, victim: Callable[[], int | None], timeout: float = 420):
    """Start the run, SIGKILL the pid ``victim()`` returns once it returns one, wait for the end. Returns the run,
    the killed pid, the seconds from the kill to the exit and processes.json as it was just before the kill."""
    proc: subprocess.Popen = start_train(args, extra_env=env)
    try:
        deadline = time.monotonic() + timeout
        while (pid := victim()) is None:
            assert proc.poll() is None, proc.stdout.read()[-5000:]
            assert time.monotonic() < deadline, "never reached the place to kill at"
            time.sleep(0.1)
        before = json.loads((out_dir / "processes.json").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            output, _ = proc.communicate(timeout=max(2 * EXIT_BOUND, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run still goes on {time.monotonic() - killed_at:.0f}s after the kill of pid {pid}")
        return Run(proc.returncode, output, out_dir), pid, time.monotonic() - killed_at, before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _processes(out_dir: Path) -> dict | None:
    path = out_dir / "processes.json"
    return json.loads(path.read_text()) if path.exists() else None


def _every_pid(procs: dict) -> list[int]:
    return [*all_pids(procs), *procs["train_workers_started"], *procs["executors_started"]]


def _rank1_while_generating(out_dir: Path) -> Callable[[], int | None]:
    """Rank 1's pid once engine 0 holds requests of the first rollout (the driver waits for it)."""

    def victim() -> int | None:
        procs, log = _processes(out_dir), out_dir / "engine_0.log"
        found = re.search(r"serving \S+ on (http://\S+)", log.read_text()) if log.exists() else None
        if procs is None or found is None:
            return None
        if requests.get(found.group(1) + "/get_load", headers=ENGINE_AUTH, timeout=5).json()["num_running_reqs"] == 0:
            return None
        return procs["train_workers"][1]

    return victim


def _rank1_stalled_in(method: str, marks: Path) -> Callable[[], int | None]:
    """Rank 1's pid once both ranks entered ``method`` (rank 0 then waits in a barrier for rank 1)."""

    def victim() -> int | None:
        ranks = [marks / f"{method}_rank{r}" for r in (0, 1)]
        return int(ranks[1].read_text()) if all(p.exists() for p in ranks) else None

    return victim


# The watch is one race for whatever the loop awaits: a rollout (the driver waits on the executor) and a train step
# (the other rank blocked in a gloo collective) are its two distinct cases; push_weights and save ran the same way.
@pytest.mark.parametrize("during", ["rollout", "train"])
def test_without_fault_tolerance_a_dead_training_worker_ends_the_run_naming_it(during, tiny_model, tiny_task, tmp_path):
    out = tmp_path / "out"
    extra = [*TWO_WORKERS, "--num-rollout", "4", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    if during == "rollout":
        # A first decode step of 10 minutes: the rollout cannot end before the run notices the dead worker.
        env, victim = fixed_step_cost_env(600), _rank1_while_generating(out)
    else:
        marks = tmp_path / "marks"
        marks.mkdir()
        env, victim = stall_env(during, marks), _rank1_stalled_in(during, marks)
    run, pid, seconds, before = _kill_and_wait(tiny_args(tiny_model, tiny_task, out, *extra), env, out, victim)
    assert run.returncode != 0
    assert seconds < EXIT_BOUND, (seconds, run.output[-5000:])
    assert pid == before["train_workers"][1]
    assert f"training worker actor rank 1 (pid {pid}, node " in run.output, run.output[-5000:]
    assert "the run stops (--use-fault-tolerance would rebuild" in run.output
    assert wait_all_dead(_every_pid(run.processes())) == []


FT = [
    *TWO_WORKERS,
    "--use-fault-tolerance",
    "--check-weight-update-equal",
    "--num-rollout",
    "8",
    "--save-interval",
    "2",
]


def _after_steps(out_dir: Path, steps: int) -> Callable[[], int | None]:
    """Rank 1's pid once ``steps`` steps are logged."""

    def victim() -> int | None:
        metrics = out_dir / "metrics.jsonl"
        if not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
            return None
        return _processes(out_dir)["train_workers"][1]

    return victim


def test_with_fault_tolerance_the_trainers_restart_from_the_checkpoint_and_no_prompt_is_lost_or_repeated(
    tiny_model, tiny_task, tmp_path
):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, tiny_task, out, *FT, "--save", str(tmp_path / "ckpt"))
    run, pid, _, before = _kill_and_wait(args, {}, out, _after_steps(out, 3))
    assert run.returncode == 0, run.output[-5000:]
    restarted = re.findall(
        r"training worker actor rank 1 \(pid (\d+), node \S+\) died: .*?; trainer restart 1 of "
        r"--max-trainer-restarts 3: rebuilding the training workers and the rollout executor from checkpoint "
        r"(\d+) in \S+, then going on from rollout (\d+)",
        run.output,
    )
    assert len(restarted) == 1 and int(restarted[0][0]) == pid, run.output[-5000:]
    saved, resumed = int(restarted[0][1]), int(restarted[0][2])
    assert resumed == saved + 1 and saved in (1, 3, 5)  # --save-interval 2: checkpoints of rollouts 1, 3, ...

    procs = run.processes()
    # The engines stayed up; the training workers and the executor were replaced.
    assert procs["engines_started"] == procs["engines"] == before["engines"]
    assert pid in procs["train_workers_started"] and pid not in procs["train_workers"]
    assert len(procs["train_workers_started"]) == 4 and len(procs["executors_started"]) == 2
    assert procs["executor"] != before["executor"]

    # The steps after the checkpoint were done again, marked by the restart counter; the run reached the end.
    m = run.metrics
    redone = [r["step"] for r in m if r["trainer/restarts"] == 1]
    assert redone == list(range(resumed + 1, 9))
    assert [r["step"] for r in m if r["trainer/restarts"] == 0][: resumed + 1] == list(range(1, resumed + 2))

    # The restored weights went to the engines, and every update since holds the trainer's bytes.
    checked = [int(v) for v in re.findall(r"--check-weight-update-equal: version (\d+) identical", run.output)]
    assert checked[-(9 - resumed) :] == list(range(resumed, 9)) and checked.count(resumed) == 2, checked

    # The final lineage (the last record of each rollout) trains each of the 64 prompts of the epoch once.
    last = {r["rollout_id"]: r for r in run.rollouts}
    assert sorted(last) == list(range(8))
    uids = [u for rid in range(8) for u in last[rid]["uids"]]
    assert len(uids) == len(set(uids)) == 64
    assert wait_all_dead(_every_pid(procs)) == []


def test_past_max_trainer_restarts_the_run_fails_naming_the_bound(tiny_model, tiny_task, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, tiny_task, out, *FT, "--save", str(tmp_path / "ckpt"), "--max-trainer-restarts", "0")
    run, pid, seconds, _ = _kill_and_wait(args, {}, out, _after_steps(out, 1))
    assert run.returncode != 0
    assert seconds < EXIT_BOUND, seconds
    assert f"training worker actor rank 1 (pid {pid}, node " in run.output, run.output[-5000:]
    assert "0 trainer restart(s) already used of --max-trainer-restarts 0" in run.output
    assert wait_all_dead(_every_pid(run.processes())) == []
