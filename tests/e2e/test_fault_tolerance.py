"""An engine SIGKILLed mid-rollout: with --use-fault-tolerance the run goes on and the engine comes back;
without it the run fails fast and clearly. Two embedded engines, a tiny model, real Ray."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import requests

from benchmarks.engine_doubles import fixed_step_cost_env
from tests.e2e.runner import ENGINE_AUTH, Run, all_pids, start_train, tiny_args, wait_all_dead, without_rm_type

NUM_ROLLOUT = 8
# Two engines; slow decoding (32 tokens at >= 50 ms a step: an engine double) so a rollout lasts seconds and
# the kill lands while requests are in flight on the killed engine.
ARGS = [
    "--rollout-num-gpus",
    "2",
    "--rollout-num-threads",
    "1",
    "--num-rollout",
    str(NUM_ROLLOUT),
    "--rollout-max-response-len",
    "32",
    "--custom-rm-path",
    "tests.e2e.rewards:starts_with_digit",
]
SLOW_STEPS = fixed_step_cost_env(0.05)
FT = [
    "--use-fault-tolerance",
    "--rollout-health-check-interval",
    "0.5",
    "--rollout-health-check-timeout",
    "2",
    "--check-weight-update-equal",
]


def _run_and_kill_an_engine(args: list[str], out_dir: Path, timeout: float = 400) -> tuple[Run, int, float]:
    """Start the run, SIGKILL engine 1 once the first step is logged and it is generating (mid-rollout),
    and wait for the end. Returns the run, the killed pid and the seconds from the kill to the exit."""
    proc: subprocess.Popen = start_train(args, extra_env=SLOW_STEPS)
    try:
        deadline = time.monotonic() + timeout
        metrics = out_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the first step never finished"
            time.sleep(0.1)
        pid = json.loads((out_dir / "processes.json").read_text())["engines"][1]
        url = re.search(r"serving \S+ on (http://\S+)", (out_dir / "engine_1.log").read_text()).group(1)
        while (
            requests.get(url + "/get_load", headers=ENGINE_AUTH, timeout=5).json()["num_running_reqs"] == 0
        ):  # mid-rollout
            assert proc.poll() is None and time.monotonic() < deadline, "engine 1 never got a request"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return Run(proc.returncode, output, out_dir), pid, time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_engine_does_not_stop_the_run_and_comes_back(tiny_model, tiny_task, tmp_path):
    run, killed, _ = _run_and_kill_an_engine(
        without_rm_type(tiny_args(tiny_model, tiny_task, tmp_path, *ARGS, *FT)), tmp_path
    )
    assert run.returncode == 0, run.output[-5000:]
    m = run.metrics
    assert [r["step"] for r in m] == list(range(1, NUM_ROLLOUT + 1))
    # Every sample is accounted for: full rollouts, each prompt once (8 rollouts x 8 = the 64 prompts).
    assert all(r["rollout/num_samples"] == 32 for r in m)
    uids = [u for r in run.rollouts for u in r["uids"]]
    assert [r["rollout_id"] for r in run.rollouts] == list(range(NUM_ROLLOUT))
    assert len(uids) == len(set(uids)) == 64
    # The kill landed mid-rollout (requests on the dead engine were retried), the engine was restarted
    # once and serves again at the end.
    last = m[-1]
    assert last["engine/request_retries"] >= 1, last
    assert last["engine/restarts"] == 1 and last["engine/serving"] == 2, last
    procs = run.processes()
    assert killed not in procs["engines"] and len(procs["engines_started"]) == 3
    restarted = re.findall(
        r"engine 1 restarted: pid (\d+) at (\S+), weight version (\d+) copied from engine 0", run.output
    )
    assert len(restarted) == 1 and int(restarted[0][0]) == procs["engines"][1], run.output[-5000:]
    # It got the current weights before serving, and every later update reached it byte for byte.
    url = restarted[0][1].rstrip(",")
    checked = re.findall(r"--check-weight-update-equal: version (\d+) identical on \[(.*?)\]", run.output)
    assert [int(v) for v, _ in checked] == list(range(NUM_ROLLOUT + 1))
    assert url in checked[-1][1] and checked[-1][1].count("http://") == 2
    assert wait_all_dead(all_pids(procs)) == []


def test_without_fault_tolerance_a_killed_engine_fails_the_run_fast(tiny_model, tiny_task, tmp_path):
    run, _, seconds = _run_and_kill_an_engine(
        without_rm_type(tiny_args(tiny_model, tiny_task, tmp_path, *ARGS)), tmp_path
    )
    assert run.returncode != 0
    assert seconds < 60, seconds
    assert "the engine may have died" in run.output and "--use-fault-tolerance" in run.output, run.output[-5000:]
    assert len(run.metrics) < NUM_ROLLOUT
    assert wait_all_dead(all_pids(run.processes())) == []
