"""Shared helpers for the benchmarks: machine info, the model and prompts, a managed engine, result tables."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import record

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def machine_info() -> dict[str, Any]:
    import transformers

    from miles_async.config.precision import cpu_has_bf16

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parent,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError):
        mem_gib = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        # Affinity, not os.cpu_count(): a container may see the host's cores but be pinned to fewer.
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": mem_gib,
        # Our --bf16 runs bf16 on a CPU only where it computes it natively: CPU runs' numbers depend on it.
        "cpu_bf16": cpu_has_bf16(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
    }


# What a kept run records of the machine it ran on: its figures depend on them (bf16 or not above all).
STAMPED_MACHINE = record.STAMPED_MACHINE


def ran_stamp() -> dict[str, Any]:
    """Where a kept benchmark run comes from: the commit and date it ran at, the machine, and the 1-minute load as
    it started."""
    info = machine_info()
    return {
        "commit": info["git_commit"],
        "date": info["date"],
        "machine": {k: info[k] for k in STAMPED_MACHINE},
        "load": [round(os.getloadavg()[0], 1)],
    }


def finish_stamp(ran: dict[str, Any]) -> dict[str, Any]:
    """``ran`` with the 1-minute load as the run ended."""
    return {**ran, "load": [*ran["load"], round(os.getloadavg()[0], 1)]}


def kept_machine(ran: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The entry's machine when its runs were kept from earlier invocations: the commits and first date they ran at,
    and the machine they ran on, not the one summing them up (a run kept on one machine and summed up on another
    keeps its own CPU and precision). Runs kept on different machines fail: their figures do not add up."""
    machines = [r["machine"] for r in ran]
    if any(m != machines[0] for m in machines):
        raise ValueError(f"the kept runs ran on different machines: {machines}")
    commits = list(dict.fromkeys((r["commit"] or "?")[:7] for r in ran))
    return {**machine_info(), **machines[0], "git_commit": ", ".join(commits), "date": min(r["date"] for r in ran)}


def smollm2_path() -> Path:
    from miles_async.assets.smollm2 import prepare_smollm2

    return prepare_smollm2()


def multiplication_prompts(work_dir: Path) -> tuple[Path, list[str]]:
    """The multiplication train split (JSONL path, prompt texts), in file order so every run sees the same prompts."""
    from miles_async.assets.arith_dataset import (
        make_multiplication_dataset,
        read_records,
    )

    train, _ = make_multiplication_dataset(Path(work_dir) / "mul", seed=0)
    return train, [r["prompt"] for r in read_records(train)]


def engine_config(
    model_path: Path,
    prompt_data: Path,
    dtype: str,
    num_threads: int,
    max_running: int = 64,
    out_dir: Path | None = None,
):
    """An EngineConfig built the way the trainer builds it (parse_args), so flag defaults stay in one place."""
    from miles_async.arguments import parse_args

    out_dir = out_dir or Path(tempfile.gettempdir())
    cfg = parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            str(model_path),
            "--prompt-data",
            str(prompt_data),
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--rm-type",
            "first_integer",
            "--rollout-dtype",
            dtype,
            "--rollout-num-threads",
            str(num_threads),
            "--sglang-server-concurrency",
            str(max_running),
            "--output-dir",
            str(out_dir),
        ]
    )
    return cfg.engine


@contextlib.contextmanager
def running_engine(engine_cfg, log_dir: Path, index: int = 0, startup_timeout: float = 300.0) -> Iterator[Any]:
    """A real engine server process for the duration of the block; stopped however the block exits."""
    from miles_async.inference.embedded.launcher import EmbeddedEngineProcess

    proc = EmbeddedEngineProcess(engine_cfg, index, str(log_dir))
    try:
        proc.start()
        proc.wait_healthy(startup_timeout)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


ROOT = Path(__file__).resolve().parents[1]


def ensure_commit(commit: str, repo: Path = ROOT) -> str:
    """``commit`` in ``repo``'s object store: a shallow clone (CI's may be one) fetches it from ``origin``, by its
    full hash. Raises naming the commit and what to do where that fails too."""

    def have() -> bool:
        probe = ["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0

    if have():
        return commit
    fetch = subprocess.run(
        ["git", "-C", str(repo), "fetch", "--quiet", "--depth", "1", "origin", commit],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if fetch.returncode != 0 or not have():
        raise RuntimeError(
            f"commit {commit} is not in {repo} (a shallow clone?) and `git fetch origin {commit}` failed: "
            f"{fetch.stderr.strip()[-500:]}; clone with full history (no --depth, or "
            f"git fetch --unshallow) to compare against it"
        )
    return commit


def export_tree(commit: str, dest: Path) -> Path:
    """``commit``'s files under ``dest`` (``git archive``: reads the object store, changes no git state), for
    running an older revision side by side with this one."""
    ensure_commit(commit)
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, timeout=120, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, timeout=120, check=True)
    return dest


CONSTANT_REWARD = ("--custom-rm-path", "benchmarks.workloads:constant_reward")


def tiny_run_flags(
    model: Path,
    data: Path,
    batch: int,
    samples: int,
    max_len: int,
    reward: Sequence[str] = CONSTANT_REWARD,
    generate: str | None = None,
    rollout_dtype: str | None = "float32",
) -> list[str]:
    """The ``train_async.py`` flags the benchmarks' runs on a tiny model share: the model and its prompts (chat
    template), the reward (a constant by default), the generation workload of ``benchmarks/workloads.py`` if any,
    ``batch`` prompts of ``samples`` answers of at most ``max_len`` tokens, and the engine's dtype (None: the
    default)."""
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--apply-chat-template", *reward]
    if generate is not None:
        flags += ["--custom-generate-function-path", f"benchmarks.workloads:{generate}"]
    flags += ["--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(samples)]
    flags += ["--rollout-max-response-len", str(max_len)]
    return flags + (["--rollout-dtype", rollout_dtype] if rollout_dtype else [])


def run_train_async(args: list[str], out: Path, timeout: float = 1800, extra_env: dict | None = None) -> list[dict]:
    """One real ``train_async.py`` run in a subprocess (``extra_env`` added to its environment); returns its
    metrics.jsonl rows."""
    import json
    import sys

    env = dict(
        os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(extra_env or {})
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_async.py"), *args, "--output-dir", str(out), "--no-plot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"train_async.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run_quickstart(
    flags: Sequence[str], model: Path, data: Path, out: Path, timeout: float, tree: Path = ROOT
) -> list[dict]:
    """``tree``'s quickstart launcher (README command 1's ``scripts/run-smollm2-cpu-async.sh``) with ``flags`` after its
    own, on ``model`` and ``data``, output in ``out``; returns its metrics.jsonl rows."""
    import json
    import sys

    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MODEL=str(model),
        DATA=str(data),
        OUT=str(out),
        PYTHON=sys.executable,
    )
    cmd = ["bash", str(tree / "scripts" / "run-smollm2-cpu-async.sh"), *flags]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: the quickstart launcher failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def tiny_setup(work: Path, n_train: int = 256) -> tuple[Path, Path, Path]:
    """A tiny random model and its task data (train, eval) under ``work``: cheap controlled-cost runs."""
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    model = make_tiny_model(work / "model", seed=0)
    train, held_out = make_tiny_task_dataset(work / "data", n_train=n_train, n_eval=16, seed=0)
    return model, train, held_out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def eval_curve(
    metrics: list[dict], evals: list[dict], key: str, between_steps: bool = False
) -> list[tuple[int, float, float]]:
    """A run's held-out accuracy ``key`` as (step, accuracy, seconds): wall time since the first rollout began,
    when each eval started (its weights were ready). Background evals finish out of order: sorted by step.
    ``between_steps`` (--synchronous, whose evals run between steps): the evals before each are taken out of the
    clock, as TRL's runner does with its own."""
    start = metrics[0]["rollout/started_at"]
    out, evaluating = [], 0.0
    for e in sorted(evals, key=lambda e: e["step"]):
        if key in e:
            out.append((e["step"], e[key], e["eval/started_at"] - start - evaluating))
        if between_steps and e["step"] > 0:  # step 0's eval ran before the first rollout, off the clock already
            evaluating += e["eval/seconds"]
    return out


def step_seconds(metrics: list[dict], between_steps: bool = False) -> list[float]:
    """Each step's wall time; ``between_steps`` (--synchronous): without the eval run between steps."""
    return [r["time/step_seconds"] - (r.get("time/eval_seconds", 0.0) if between_steps else 0.0) for r in metrics]


def time_to_reach(curve: Sequence[tuple[int, float, float]], level: float) -> tuple[int, float] | None:
    """(step, seconds) of the first eval after step 0 at or above ``level``; None when never reached.
    Step 0 is left out: it measures the untrained model, which reaches a low level in no time."""
    for step, acc, seconds in curve:
        if step > 0 and acc >= level - 1e-9:
            return step, seconds
    return None


RECORD_HELP = "also store the run in benchmarks/results/results.json, stamped with this command"


def write_entry(entry: dict, out: Path, name: str | None = None, argv: Sequence[str] | None = None) -> None:
    """A standalone benchmark's result: ``out``/results.json, and its tables on stdout; with ``name`` (its
    ``--record``), also stored in benchmarks/results/results.json as benchmark ``name``, stamped with the command
    ``python -m benchmarks.<name> <argv>`` (argv: the process's own when None)."""
    import json
    import sys

    (out / "results.json").write_text(json.dumps(entry, indent=1) + "\n")
    for t in entry["tables"]:
        print(render_table(t))
    if name is not None:
        command = record.command_line(f"benchmarks.{name}", sys.argv[1:] if argv is None else argv)
        results = record.load()
        key = record.put(results, name, entry, command, entry.get("machine") or machine_info())
        record.save(results)
        print(f"recorded in {record.RESULTS} as {key!r}")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], note: str | None = None) -> dict:
    """One Markdown table of a benchmark's result; run.py renders every ``tables`` entry it finds."""
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows], "note": note}


def fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        if x == 0 or abs(x) >= 100:
            return f"{x:.0f}" if abs(x) >= 100 else "0"
        return f"{x:.{digits}g}"
    return str(x)


def render_table(t: dict) -> str:
    lines = [
        f"**{t['title']}**",
        "",
        "| " + " | ".join(t["columns"]) + " |",
        "|" + "|".join("---" for _ in t["columns"]) + "|",
    ]
    for row in t["rows"]:
        lines.append("| " + " | ".join(fmt(x) for x in row) + " |")
    if t.get("note"):
        lines += ["", t["note"]]
    return "\n".join(lines)
