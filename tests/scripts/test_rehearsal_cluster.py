"""The GPU cluster path rehearsed on this machine: scripts/slurm/train-async.sbatch starts a three-node Ray cluster (a
head and two workers, each its own `ray start` with 2 logical GPUs and a Ray resource naming its node) and runs
the Qwen3-30B-A3B launcher (scripts/run-qwen3-30B-A3B-async.sh) as written, on a tiny random Qwen3-MoE
(MODEL_ARGS_FILE=scripts/models/qwen3-moe-tiny.sh), with the real train_async.py: Megatron TP 2 x EP 2 over gloo
on two nodes and two real SGLang CPU servers on the third. Sizes come from flags appended to the launcher's
command, as an operator would give them.

Stand-ins, for what cannot run here: `srun` and `scontrol` (tests/scripts/stubs: every "node" is a set of local
processes) and the GPUs (Ray's logical GPUs; every process computes on the CPU).

The run records where each actor worker and engine ran and which GPUs Ray gave it (processes.json's
"placement"); the actor and the engines must sit on different nodes with disjoint GPUs, each TP group on one
node. Then Slurm's warning before the time limit (USR1): the run saves, the job asks to be requeued and Slurm
stops it (SIGTERM); nothing is left running on any node. What the requeued job does next is tested in parts,
each where it is cheap: the script restarts the same command with ``--load`` (tests/scripts/test_slurm.py), and a
run resumes exactly from a checkpoint, Megatron's MoE included (tests/e2e/test_train_async.py,
tests/e2e/test_megatron_moe.py).

One run does all of it: a second cluster for the dense Qwen3-4B launcher (TP 2, one SGLang server) took 85 s of
the suite's 20 minutes and repeated what this run covers; that launcher's exact command goes through
train_async.py --check-config against a tiny Qwen3 in tests/scripts/test_check_config.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.runner import all_pids, wait_all_dead
from tests.engine_envs import engine_python as _engine_python
from tests.scripts.helpers import ROOT, Job, cmdline, marked_pids, wait_marked_gone

pytestmark = pytest.mark.sglang

NODES = ["node1", "node2", "node3"]
NODE_RESOURCE = "rehearsal_"  # each Ray node's resource "rehearsal_<Slurm node>" (the stub srun adds it)
# Far more than the run reaches before Slurm stops it after the save: with 10, a loaded machine let the dense
# rehearsal (0.3 s steps) reach its end between the save and the SIGTERM (2026-12-06).
NUM_ROLLOUT = 1000
LAUNCHER = ["bash", str(ROOT / "scripts" / "run-qwen3-30B-A3B-async.sh")]
# Appended to the launcher's command (they override its own): the MoE launcher's layout at toy size, 4 Megatron
# workers on 2 nodes as TP 2 (sequence parallel, which MoE layers under TP need) x EP 2 with expert TP 1 (each TP
# group on one node, the experts split across the two), and 2 SGLang engines of 1 GPU on the third node; 2 prompts
# x 2 samples a step, 4-token answers, one tiny eval before training.
SIZES = [
    "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
    "--expert-model-parallel-size", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
    "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
    "--global-batch-size", "4", "--rollout-max-response-len", "4",
    "--eval-max-response-len", "4", "--n-samples-per-eval-prompt", "1",
]  # fmt: skip
# What the CPU needs: fp32 engines (SGLang's CPU kernels), one trainer thread per worker on 2 cores, a generous
# start-up for two engine servers and four Megatron workers sharing them, no plot.
CPU = ["--rollout-dtype", "float32", "--train-num-threads", "1", "--engine-startup-timeout", "400", "--no-plot"]


def _model_and_data(tmp: Path) -> tuple[Path, Path]:
    """The tiny Qwen3-MoE and the tiny task at the paths the launcher reads under DATA_DIR."""
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    model = make_tiny_model(tmp / "moe", seed=2, arch="qwen3_moe", tied=False)
    train, held_out = make_tiny_task_dataset(tmp / "task", n_train=64, n_eval=8, seed=0)
    data = tmp / "data"
    for src, dst in ((train, "dapo-math-17k/dapo-math-17k.jsonl"), (held_out, "aime-2024/aime-2024.jsonl")):
        (data / dst).parent.mkdir(parents=True)
        (data / dst).write_text(src.read_text())
    return model, data


def _ray_nodes(job: Job) -> dict[str, str]:
    """Ray node id -> Slurm node name, asked of the live cluster (each node's "rehearsal_<name>" resource)."""
    code = (
        "import json, logging, sys, ray\n"
        "ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)\n"
        "print(json.dumps({n['NodeID']: [r for r in n['Resources'] if r.startswith(sys.argv[2])]\n"
        "                  for n in ray.nodes() if n['Alive']}))\n"
    )
    address = re.search(r"head \S+ at (\S+)", job.log).group(1)
    proc = subprocess.run(
        [sys.executable, "-c", code, address, NODE_RESOURCE],
        env={**job.env, "RAY_AUTH_MODE": "token"},  # as the script's own poller
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resources = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(len(names) == 1 for names in resources.values()), resources  # one rehearsal resource a node
    return {node_id: names[0].removeprefix(NODE_RESOURCE) for node_id, names in resources.items()}


def _check_placement(procs: dict, nodes: dict[str, str]) -> None:
    """The actor's 4 workers on 2 nodes (each TP group on one), the 2 engines on the third, every process with one
    GPU of its own."""
    placement = procs["placement"]
    actor = sorted((p for p in placement if p["role"] == "actor"), key=lambda p: p["index"])
    engines = sorted((p for p in placement if p["role"] == "rollout"), key=lambda p: p["index"])
    assert [p["index"] for p in actor] == [0, 1, 2, 3] and [p["index"] for p in engines] == [0, 1], placement
    assert {p["pid"] for p in actor} == set(procs["train_workers"]), placement
    assert {p["pid"] for p in engines} == set(procs["engines"]), placement
    assert {p["node_id"] for p in placement} <= set(nodes), (placement, nodes)
    actor_nodes, engine_nodes = {p["node_id"] for p in actor}, {p["node_id"] for p in engines}
    assert len(actor_nodes) == 2 and len(engine_nodes) == 1, f"--actor-num-nodes 2: {placement}"
    # Ranks 0-1 and 2-3 are the TP groups (TP is the innermost dimension): each on one node.
    assert actor[0]["node_id"] == actor[1]["node_id"] != actor[2]["node_id"] == actor[3]["node_id"], placement
    assert actor_nodes.isdisjoint(engine_nodes), f"actor and engines share a node: {placement} ({nodes})"
    # Every "node" has this machine's address, so a GPU is (Ray node id, GPU id on that node).
    gpus = [(p["node_id"], g) for p in actor + engines for g in p["gpu_ids"]]
    assert all(len(p["gpu_ids"]) == 1 for p in actor + engines), placement
    assert len(set(gpus)) == len(gpus) == 6, f"a GPU given twice: {placement}"


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _check_trained(metrics: list[dict], out: Path, engines: int) -> None:
    """Each step trained the actor and pushed its weights to the engines by the distributed route, and each SGLang
    server took every update (its own log says so). This is the suite's train_async.py run with SGLang."""
    for m in metrics:
        assert m["train/optimizer_steps"] == m["weights/version"] == m["step"] and m["weights/bytes"] > 0, m
        assert m["weights/push_seconds"] > 0, m
    logs = sorted(out.glob("engine_*.log"))
    assert len(logs) == engines, logs
    for log in logs:
        text = log.read_text(errors="replace")
        assert "sglang" in text.lower() and text.count("update_weights_from_distributed") >= len(metrics), log


def _check_nothing_left(job: Job, procs: dict) -> None:
    """Every process the run recorded and every process of the job (Ray on each node included) has ended."""
    assert wait_marked_gone(job.marker, 60) == [], [cmdline(p) for p in marked_pids(job.marker)]
    left = wait_all_dead([procs["driver"], *all_pids(procs)], timeout=5)
    assert left == [], [cmdline(p) for p in left]


def _job(job_factory, model_args: str, nodes: list[str]) -> Job:
    """The Slurm script's job on the rehearsal's ``nodes``, with the launcher's model args from
    scripts/models/``model_args``."""
    return job_factory(
        nodes,
        MILES_ASYNC_SGLANG_PYTHON=_engine_python("sglang"),
        STUB_SRUN_NODE_RESOURCE=NODE_RESOURCE,
        RAY_ADDRESS="",
        RAY_START_TIMEOUT="180",
        RAY_raylet_start_wait_time_s="120",  # three nodes starting at once on 2 cores
        RAY_STOP_GRACE="60",  # the run stops its engines (a few seconds each) before Ray goes
        SAVE_TIMEOUT="300",
        MODEL_ARGS_FILE=str(ROOT / "scripts" / "models" / model_args),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def test_rehearsal_cluster_trains_the_moe_launcher_places_apart_saves_on_usr1_and_requeues(job_factory):
    t0 = time.monotonic()
    job = _job(job_factory, "qwen3-moe-tiny.sh", NODES)
    model, data = _model_and_data(job.tmp)
    out = job.tmp / "out"
    job.env.update(HF_CHECKPOINT=str(model), DATA_DIR=str(data), OUT=str(out))

    # The cluster comes up, the run trains.
    job.start(*LAUNCHER, *SIZES, *CPU)
    job.wait_for("the first training step", lambda: len(_metrics(out)) >= 1, timeout=600)
    # Slurm's warning before the time limit: the run saves after its current step, then the job asks to be
    # requeued. (Sent at once: steps take seconds, and the run must still be training when Slurm stops it.)
    os.kill(job.proc.pid, signal.SIGUSR1)

    # Meanwhile, where the run placed its processes, on the live cluster.
    nodes = _ray_nodes(job)
    assert sorted(nodes.values()) == NODES, nodes
    procs = json.loads((out / "processes.json").read_text())
    _check_placement(procs, nodes)

    pointer = job.save_dir / "latest_checkpointed_iteration.txt"
    scontrol_log = job.tmp / "scontrol.log"
    job.wait_for("scontrol requeue after the save", scontrol_log.exists, timeout=300)
    # Slurm requeues: SIGTERM to the batch script at once, as Slurm stops a requeued job; the script stops the run
    # and Ray on every node.
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait_exit(180) == 143, job.log[-5000:]
    assert scontrol_log.read_text().split() == ["requeue", "4242"]
    sentinel_saves = re.findall(
        rf"saved rollout (\d+) on the sentinel {re.escape(str(job.save_dir / 'SAVE_NOW'))}", job.log
    )
    assert len(sentinel_saves) == 1, job.log[-5000:]
    saved = int(sentinel_saves[0])
    # The launcher's --save-interval may have saved again before the SIGTERM landed: the pointer never goes back.
    assert int(pointer.read_text()) >= saved
    assert (job.save_dir / f"iter_{saved:07d}" / "actor" / "megatron" / ".metadata").is_file()
    assert not (job.save_dir / "SAVE_NOW").exists()
    metrics = _metrics(out)
    # The sentinel save of rollout `saved` precedes that step's metrics row; SIGTERM may land between them.
    assert [m["step"] for m in metrics][:saved] == list(range(1, saved + 1)), metrics
    assert max(m["step"] for m in metrics) < NUM_ROLLOUT, "the run ended before Slurm stopped it"
    _check_trained(metrics, out, 2)
    # Step 1 trains on samples of the initial weights, which the trainer still holds: SGLang's MoE and
    # Megatron's agree on their log-probs (a head or experts SGLang failed to load would put them nats apart).
    assert metrics[0]["train/train_rollout_logprob_abs_diff"] < 1e-2, metrics[0]
    _check_nothing_left(job, procs)
    print(f"rehearsal cluster: {time.monotonic() - t0:.0f} s (saved at rollout {saved}), step 1's train-rollout "
          f"log-prob gap {metrics[0]['train/train_rollout_logprob_abs_diff']:.2e}")  # fmt: skip
