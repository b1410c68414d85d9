"""Run ``train_async.py`` as a real subprocess (real Ray, real engine) and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from miles_async.inference.auth import auth_headers
from miles_async.utils.api_key import API_KEY_ENV, new_api_key
from tests import ray_cluster

ROOT = Path(__file__).resolve().parents[2]
# Every run's engines require this key (given as the user's own, $MILES_ASYNC_ENGINE_API_KEY), so a test can call
# them itself with ENGINE_AUTH.
ENGINE_KEY = new_api_key()
ENGINE_AUTH = auth_headers(ENGINE_KEY)


@dataclass
class Run:
    returncode: int
    output: str
    out_dir: Path

    def jsonl(self, name: str) -> list[dict]:
        path = self.out_dir / name
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    @property
    def metrics(self) -> list[dict]:
        return self.jsonl("metrics.jsonl")

    @property
    def evals(self) -> list[dict]:
        return self.jsonl("eval.jsonl")

    @property
    def rollouts(self) -> list[dict]:
        return self.jsonl("rollouts.jsonl")

    def processes(self) -> dict:
        return json.loads((self.out_dir / "processes.json").read_text())


def tiny_args(model: Path, task: tuple[Path, Path], out_dir: Path, *extra: str) -> list[str]:
    train, held_out = task
    return [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(train),
        "--eval-prompt-data",
        "tiny",
        str(held_out),
        "--apply-chat-template",
        "--use-tis",
        "--rm-type",
        "first_integer",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--rollout-dtype",
        "float32",
        "--lr",
        "3e-3",
        "--rollout-shuffle",
        "--output-dir",
        str(out_dir),
        "--no-plot",
        *extra,
    ]


def without_rm_type(args: list[str]) -> list[str]:
    """tiny_args scores with --rm-type; runs that bring a --custom-rm-path drop it."""
    i = args.index("--rm-type")
    return args[:i] + args[i + 2 :]


def env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        RAY_DEDUP_LOGS="0",
        **{API_KEY_ENV: ENGINE_KEY.reveal()},
    )


def _on_cluster(args: list[str], extra_env: dict | None, own_cluster: bool) -> tuple[list[str], dict]:
    """The run's command-line flags and environment: joining the session's shared Ray cluster
    (tests/ray_cluster.py) unless it brings its own ``--ray-address`` or must start a cluster of its own."""
    environment = {**env(), **(extra_env or {})}
    if own_cluster or "--ray-address" in args:
        return args, environment
    return [*args, "--ray-address", ray_cluster.address()], {**environment, **ray_cluster.join_env()}


def run_train(
    args: list[str], out_dir: Path, timeout: float = 300, extra_env: dict | None = None, own_cluster: bool = False
) -> Run:
    """``train_async.py args`` to its end; ``own_cluster``: it starts (and must stop) a Ray cluster of its own."""
    args, environment = _on_cluster(args, extra_env, own_cluster)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_async.py"), *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr, out_dir)


def start_train(args: list[str], extra_env: dict | None = None, own_cluster: bool = False) -> subprocess.Popen:
    args, environment = _on_cluster(args, extra_env, own_cluster)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train_async.py"), *args],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def drain(proc: subprocess.Popen, into: list[str]) -> threading.Thread:
    """Read a started run's output as it comes, so a full pipe never blocks its progress bar."""
    t = threading.Thread(target=lambda: into.extend(iter(proc.stdout.readline, "")), daemon=True)
    t.start()
    return t


def wait_api_file(path: Path, proc: subprocess.Popen, output: list[str], timeout: float = 240) -> dict:
    """The control API's ``api.json`` (url, port, token file) once the run has written it."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "".join(output)[-5000:]
        assert time.monotonic() < deadline, "the control API never wrote api.json"
        time.sleep(0.2)
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_all_dead(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.5)
    return [p for p in pids if alive(p)]


def all_pids(procs: dict) -> list[int]:
    engines = procs.get("engines_started", procs["engines"])  # restarted engines too (--use-fault-tolerance)
    return [procs["controller"], procs["executor"], *engines, *procs["train_workers"]]


def ray_session_processes(session_dir: str) -> list[str]:
    """Command lines of live processes that belong to a Ray session (raylet, agents, workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if session_dir in cmd:
            found.append(f"{entry}: {cmd[:200]}")
    return found


def wait_session_gone(session_dir: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = ray_session_processes(session_dir)
        if not left:
            return []
        time.sleep(0.5)
    return ray_session_processes(session_dir)
