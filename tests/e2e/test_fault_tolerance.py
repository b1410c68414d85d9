"""An engine SIGKILLed mid-rollout: with --use-fault-tolerance the run goes on and the engine comes back;
without it the run fails fast and clearly. Two embedded engines, a tiny model, real Ray."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import requests

from benchmarks.engine_doubles import fixed_step_cost_env
from tests.e2e.runner import (
    ENGINE_AUTH,
    Run,
    all_pids,
    drain,
    start_train,
    tiny_args,
    wait_all_dead,
    wait_api_file,
    without_rm_type,
)

NUM_ROLLOUT = 8
MAX_ROLLOUT = 64  # with fault tolerance: stopped through the control API once the engine is back
API_TOKEN = "ft-e2e-token"
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


def _run_and_kill_an_engine(
    args: list[str], out_dir: Path, timeout: float = 400, then: Callable | None = None, extra_env: dict | None = None
) -> tuple[Run, int, float]:
    """Start the run, SIGKILL engine 1 once the first step is logged and it is generating (mid-rollout), call
    ``then(proc, output, deadline)`` if given, and wait for the end. Returns the run, the killed pid and the
    seconds from the kill to the exit."""
    proc: subprocess.Popen = start_train(args, extra_env={**SLOW_STEPS, **(extra_env or {})})
    output: list[str] = []
    reader = drain(proc, output)
    try:
        deadline = time.monotonic() + timeout
        while not _steps(out_dir):
            assert proc.poll() is None, "".join(output)[-4000:]
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
        if then is not None:
            then(proc, output, deadline)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        reader.join(timeout=30)
        return Run(proc.returncode, "".join(output), out_dir), pid, time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _steps(out_dir: Path) -> list[dict]:
    """The steps logged so far (whole lines only: the run may be writing the next)."""
    path = out_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _stop_once_engine_1_is_back(out_dir: Path) -> Callable:
    """Waits for a step logged with the killed engine restarted and serving, then stops the run through the
    control API. A fixed --num-rollout raced the restart: under load the restart could come after the last step."""

    def then(proc: subprocess.Popen, output: list[str], deadline: float) -> None:
        api = wait_api_file(out_dir / "api.json", proc, output)
        while not any(s["engine/restarts"] == 1 and s["engine/serving"] == 2 for s in _steps(out_dir)):
            assert proc.poll() is None, "the run ended before the killed engine came back\n" + "".join(output)[-4000:]
            assert time.monotonic() < deadline, "the killed engine never came back"
            time.sleep(0.2)
        r = requests.post(api["url"] + "/stop", headers={"Authorization": f"Bearer {API_TOKEN}"}, json={}, timeout=30)
        assert r.status_code == 202, r.text

    return then


def test_a_killed_engine_does_not_stop_the_run_and_comes_back(tiny_model, tiny_task, tmp_path):
    args = tiny_args(tiny_model, tiny_task, tmp_path, *ARGS, *FT, "--api-server-port", "0")
    args[args.index("--num-rollout") + 1] = str(MAX_ROLLOUT)  # a ceiling: the test stops the run
    run, killed, _ = _run_and_kill_an_engine(
        without_rm_type(args),
        tmp_path,
        then=_stop_once_engine_1_is_back(tmp_path),
        extra_env={"MILES_ASYNC_API_TOKEN": API_TOKEN},
    )
    assert run.returncode == 0, run.output[-5000:]
    assert "stopped by POST /stop" in run.output, run.output[-5000:]
    m = run.metrics
    n = len(m)
    assert [r["step"] for r in m] == list(range(1, n + 1)) and n < MAX_ROLLOUT
    # Every sample is accounted for: full rollouts, each prompt once per epoch (8 rollouts x 8 = the 64 prompts).
    assert all(r["rollout/num_samples"] == 32 for r in m)
    # One-step-off: the rollout after the last step may have been generated when the stop came.
    assert [r["rollout_id"] for r in run.rollouts] == list(range(len(run.rollouts))) and len(run.rollouts) - n in (0, 1)
    for epoch in range(0, len(run.rollouts), 8):
        uids = [u for r in run.rollouts[epoch : epoch + 8] for u in r["uids"]]
        assert len(uids) == len(set(uids)) == 8 * len(run.rollouts[epoch : epoch + 8])
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
    assert [int(v) for v, _ in checked] == list(range(n + 1))
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
