"""scripts/slurm/train-async.sbatch run for real on this machine with a stubbed `srun`
(tests/scripts/stubs: each "node" is a local `ray start --block`), a real multi-node Ray
cluster with fake GPU counts, and tests/scripts/fake_train.py as the training command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.scripts.helpers import ROOT, SBATCH, cmdline, marked_pids, wait_marked_gone

FAKE_TRAIN = [sys.executable, str(ROOT / "tests" / "scripts" / "fake_train.py")]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_two_node_cluster_then_usr1_saves_and_requeues(job_factory, tmp_path):
    # On nodes that never ran Ray (an empty home, no RAY_AUTH_TOKEN): `ray start` with token auth makes no token
    # itself, so the script makes one and hands it to both nodes and the run.
    home = tmp_path / "fresh-home"
    home.mkdir()
    job = job_factory(["node1", "node2"], HOME=str(home))
    job.env = {k: v for k, v in job.env.items() if not k.startswith("RAY_AUTH_TOKEN")}
    job.start(*FAKE_TRAIN)
    job.wait_for("the training command to join the cluster", lambda: job.report(), timeout=120)
    assert len((home / ".ray" / "auth_token").read_text().strip()) >= 32, "the script made no token"
    report = job.report()
    # Started only once every node's GPUs had joined.
    assert report["nodes"] == 2 and report["gpus"] == 4 and report["node_gpus"] == [2, 2], report
    argv = report["argv"]
    assert _flag(argv, "--ray-address").endswith(f":{job.port}")
    assert _flag(argv, "--save") == str(job.save_dir)
    assert _flag(argv, "--save-trigger-sentinel") == str(job.save_dir / "SAVE_NOW")
    assert report["load"] is None, "nothing to resume from on a first start"
    steps = job.srun_steps()
    head = [cmd for node, cmd in steps if node == "node1" and " start " in f" {cmd} " and "--head" in cmd]
    worker = [cmd for node, cmd in steps if node == "node2" and "--address=" in cmd]
    assert len(head) == 1 and f"--port={job.port}" in head[0] and "--num-gpus=2" in head[0], steps
    assert len(worker) == 1 and worker[0].split("--address=")[1].split()[0] == _flag(argv, "--ray-address"), steps
    # Two Ray nodes really run (the marker finds them, so the clean-up check below can fail).
    raylets = [p for p in marked_pids(job.marker) if "raylet/raylet" in cmdline(p)]
    assert len(raylets) == 2, raylets

    # Slurm's warning before the time limit: the sentinel appears, the run saves and
    # deletes it, then the job asks to be requeued.
    os.kill(job.proc.pid, signal.SIGUSR1)
    pointer = job.save_dir / "latest_checkpointed_iteration.txt"
    job.wait_for("the save on the sentinel", lambda: pointer.exists() and job.report()["saves"] == 1, timeout=20)
    assert not (job.save_dir / "SAVE_NOW").exists()
    scontrol_log = job.tmp / "scontrol.log"
    job.wait_for("scontrol requeue", lambda: scontrol_log.exists(), timeout=20)
    assert scontrol_log.read_text().split() == ["requeue", "4242"]
    assert "USR1" in job.log and "checkpoint saved; requeueing job 4242" in job.log

    # The run's exit status is the job's, even though a signal interrupted the script's wait.
    (job.work / "finish").write_text("5")
    assert job.wait_exit(120) == 5, job.log
    assert "training command exited with 5" in job.log
    # The script stopped both Ray nodes (and their workers) on its way out.
    assert wait_marked_gone(job.marker, 20) == [], job.log


def test_requeued_job_resumes_from_load_and_stops_cleanly_on_sigterm(job_factory):
    job = job_factory(["node1"])
    job.save_dir.mkdir(parents=True)
    (job.save_dir / "latest_checkpointed_iteration.txt").write_text("7")
    (job.save_dir / "SAVE_NOW").touch()  # left by the attempt that was preempted
    job.start(*FAKE_TRAIN)
    job.wait_for("the training command to join the cluster", lambda: job.report(), timeout=120)
    report = job.report()
    assert report["load"] == str(job.save_dir) and report["gpus"] == 2 and report["nodes"] == 1, report
    assert "resuming from" in job.log and "(iteration 7)" in job.log
    time.sleep(1)
    assert job.report()["saves"] == 0, "a stale sentinel from the previous attempt must not trigger a save"

    # scancel / requeue: SIGTERM to the batch script stops the run and Ray.
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait_exit(120) == 143, job.log
    assert "stopping the training run" in job.log and "stopping Ray on 1 node(s)" in job.log
    assert wait_marked_gone(job.marker, 20) == [], job.log


def test_a_node_that_fails_to_start_ends_the_job_with_its_name(job_factory):
    job = job_factory(["node1", "node2"], STUB_SRUN_BROKEN_NODE="node2").start(*FAKE_TRAIN)
    rc = job.wait_exit(120)
    assert rc != 0
    assert "ERROR: Ray on node node2 exited during start-up" in job.log, job.log
    assert not job.report(), "training must not start on a partial cluster"
    # A Ray process of the stopped head retries its GCS connection (5 s a try) before it exits: under the test
    # suite's load one was still there 20 s after the script (CI, 2026-12-06).
    assert wait_marked_gone(job.marker, 60) == [], job.log


def test_missing_gpus_time_out_with_what_joined(job_factory):
    job = job_factory(["node1", "node2"], STUB_SRUN_GPU_OVERRIDE="node2=1", RAY_START_TIMEOUT="15")
    t0 = time.monotonic()
    job.start(*FAKE_TRAIN)
    rc = job.wait_exit(120)
    assert rc != 0
    assert "ERROR: after 15s the Ray cluster has 2/2 nodes and 3/4 GPUs" in job.log, job.log
    assert time.monotonic() - t0 < 75
    assert not job.report()
    assert wait_marked_gone(job.marker, 20) == [], job.log


def test_outside_an_allocation_it_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(SBATCH)], env={**env, "MILES_ASYNC_ROOT": str(ROOT)}, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0
    assert "not inside a Slurm allocation" in proc.stderr
