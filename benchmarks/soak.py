"""Fault-injection soak: N short runs of ``train_async.py`` on a tiny random model. Each run SIGKILLs one target (the
driver, a training worker, an engine, the rollout executor) at a seeded moment, mid-save included, then resumes
(``--load`` from the save folder, or from scratch when nothing was saved yet) until the run finishes.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python -m benchmarks.soak --runs 20 --seed 1 --out /tmp/soak
    ... --seed 1 --only 7          # replay run 7 of seed 1 (its plan depends only on the seed and its index)

Per run it reports:

- exact: the lineage of trained rollouts (each attempt's rollouts.jsonl up to the checkpoint the next attempt
  loaded, then the last attempt's) covers rollouts 0..N-1 once and every prompt of each epoch once; one-step-off
  also: a rollout regenerated after a resume draws the same prompts as before the kill;
- pointer: latest_checkpointed_iteration.txt never named a folder without COMPLETE or any part (polled every
  ``--poll`` seconds and right after the kill);
- finished: the last attempt's metrics.jsonl reaches --num-rollout (or the kill came after the final checkpoint);
- left running: no process of processes.json nor of the Ray session it started (not a cluster it joined with
  --ray-address) outlives an attempt (any found are reported,
  then killed so the soak goes on);
- hang: an attempt that neither finished nor exited within ``--attempt-timeout`` is killed and fails the run.
- crashed: an attempt that failed with no kill to explain it (a resume, or attempt 0 before its kill) fails the run,
  with the last error line of its train.log.

Add train_async.py flags for every attempt after ``--`` (e.g. ``-- --no-async-save``).

Saves pause ``--save-pause`` seconds after the training workers wrote their part (``benchmarks/soak_doubles.py``
through ``$MILES_ASYNC_ACTOR_CLASS``), so a mid-save kill lands inside a save in progress. Writes ``soak.json``
(settings, plans, every attempt) and ``soak.md`` (the table) into ``--out``; exit status 1 when a row failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.soak_checks import (
    MODES,
    TARGETS,
    KillPlan,
    exactly_once_problems,
    expected_parts,
    lineage,
    plan_runs,
    pointer_problem,
    read_pointer,
    replay_problems,
    saves_in_progress,
)
from benchmarks.soak_doubles import paused_save_env
from tests.e2e.runner import ROOT, all_pids, env, ray_session_processes, wait_all_dead, wait_session_gone


@dataclass(frozen=True)
class Settings:
    num_rollout: int = 10  # 2.5 epochs: the run ends mid-epoch, so every epoch before the last must be complete
    num_prompts: int = 16
    batch_size: int = 4
    n_samples: int = 2
    train_workers: int = 2
    engines: int = 1
    save_pause: float = 0.3
    attempt_timeout: float = 300.0
    max_attempts: int = 4
    poll: float = 0.02
    extra_args: tuple[str, ...] = ()


@dataclass
class Attempt:
    index: int
    loaded: int | None  # the iteration it resumed from; None: from scratch
    out_dir: str
    returncode: int | None = None
    seconds: float = 0.0
    steps: int = 0  # the last step metrics.jsonl logged
    hang: bool = False
    kill: dict | None = None
    pointer_problems: list[str] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)
    error: str | None = None  # the last error line of train.log when the attempt failed by itself


def make_assets(out: Path, settings: Settings) -> tuple[Path, Path]:
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    model = make_tiny_model(out / "assets" / "model", seed=0)
    train, _ = make_tiny_task_dataset(out / "assets" / "task", n_train=settings.num_prompts, n_eval=4, seed=0)
    return model, train


def train_args(settings: Settings, model: Path, train: Path, mode: str, out_dir: Path, save: Path, load: bool) -> list:
    args = [
        "--hf-checkpoint", str(model), "--prompt-data", str(train), "--apply-chat-template", "--use-tis",
        "--rm-type", "first_integer", "--rollout-batch-size", str(settings.batch_size),
        "--n-samples-per-prompt", str(settings.n_samples), "--rollout-max-response-len", "2",
        "--rollout-dtype", "float32", "--rollout-shuffle", "--no-plot",
        "--num-rollout", str(settings.num_rollout), "--actor-num-gpus-per-node", str(settings.train_workers),
        "--rollout-num-gpus", str(settings.engines), "--rollout-num-threads", "1",
        "--output-dir", str(out_dir), "--save", str(save), "--save-interval", "1",
    ]  # fmt: skip
    if mode == "fully-async":
        args += ["--fully-async", "--max-staleness-steps", "1"]
    if load:
        args += ["--load", str(save)]
    return args + list(settings.extra_args)


def _steps(out_dir: Path) -> int:
    try:
        lines = [x for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return 0
    try:
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (ValueError, KeyError):  # a line being appended
        return len(lines)


def _processes(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / "processes.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _last_error(log: Path) -> str | None:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines()]
    errors = [x for x in lines if "Error" in x or x.startswith("error:")]
    return errors[-1][:300] if errors else (lines[-1][:300] if lines else None)


def _victim(plan: KillPlan, procs: dict, driver: int) -> int:
    if plan.target == "driver":
        return driver
    if plan.target == "executor":
        return procs["executor"]
    pids = procs["train_workers"] if plan.target == "train_worker" else procs["engines"]
    return pids[plan.pick % len(pids)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _own_session(procs: dict | None, args: list[str]) -> str | None:
    """The Ray session an attempt started, whose processes must end with it; None when it joined a cluster
    (--ray-address), which outlives every attempt by design."""
    return None if procs is None or "--ray-address" in args else procs["ray_session_dir"]


def _leftovers(procs: dict | None, args: list[str], timeout: float = 45) -> list[str]:
    """What of the attempt still runs once it ended; killed after being recorded, so the next attempt starts clean."""
    if procs is None:
        return []
    left = [f"{pid} (processes.json)" for pid in wait_all_dead([procs["driver"], *all_pids(procs)], timeout)]
    session_dir = _own_session(procs, args)
    session = wait_session_gone(session_dir, timeout) if session_dir else []
    _kill([int(x.split()[0]) for x in left] + [int(x.split(":")[0]) for x in session])
    return left + session


def run_attempt(
    index: int, args: list[str], out_dir: Path, save: Path, parts: list[str], settings: Settings, plan: KillPlan | None
) -> Attempt:
    """One ``train_async.py`` process, watched until it exits: the pointer checked every poll, ``plan``'s kill fired
    once it is due, a hang killed after ``settings.attempt_timeout``."""
    loaded = read_pointer(save) if "--load" in args else None
    attempt = Attempt(index, loaded, str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)

    def check_pointer(when: str) -> None:
        problem = pointer_problem(save, parts)
        if problem and not any(problem in p for p in attempt.pointer_problems):
            attempt.pointer_problems.append(f"{problem} ({when})")

    with open(out_dir / "train.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train_async.py"), *args],
            cwd=ROOT,
            env={**env(), **paused_save_env(settings.save_pause)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a hang is killed as a whole group
        )
    t0 = time.monotonic()
    armed = None
    while proc.poll() is None:
        now = time.monotonic() - t0
        check_pointer(f"{now:.2f}s")
        if now > settings.attempt_timeout:
            attempt.hang = True
            procs = _processes(out_dir)
            session_dir = _own_session(procs, args)
            with_session = ray_session_processes(session_dir) if session_dir else []
            _kill([proc.pid, *(all_pids(procs) if procs else []), *[int(x.split(":")[0]) for x in with_session]])
            break
        if plan is not None and attempt.kill is None:
            procs = _processes(out_dir)
            if armed is None and procs is not None and _steps(out_dir) >= plan.after_step:
                armed = now
            in_save = saves_in_progress(save)  # attempt 0 starts on an empty folder: none is left from before
            due = armed is not None and (
                (plan.moment == "timed" and now - armed >= plan.delay_s) or (plan.moment == "mid-save" and in_save)
            )
            if due:
                pid = _victim(plan, procs, proc.pid)
                _kill([pid])
                attempt.kill = {
                    "target": plan.target,
                    "pid": pid,
                    "seconds": round(now, 2),
                    "after_step": _steps(out_dir),
                    "pointer": read_pointer(save),
                    "in_save": in_save,
                }
                check_pointer("right after the kill")
                print(f"  killed {plan.target} pid {pid} at {now:.2f}s: {attempt.kill}", flush=True)
        time.sleep(settings.poll)
    proc.wait()
    attempt.seconds = round(time.monotonic() - t0, 1)
    attempt.returncode = proc.returncode
    check_pointer("after the exit")
    attempt.steps = _steps(out_dir)
    if proc.returncode not in (0, -signal.SIGKILL) and not attempt.hang:
        attempt.error = _last_error(out_dir / "train.log")
    attempt.left_running = _leftovers(_processes(out_dir), args)
    return attempt


def rollouts(out_dir: str) -> list[dict]:
    path = Path(out_dir) / "rollouts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def soak_run(plan: KillPlan, settings: Settings, model: Path, train: Path, run_dir: Path) -> dict:
    """One run: the killed attempt, then resumes until the run finishes (or ``settings.max_attempts``, or a hang)."""
    save = run_dir / "ckpt"
    parts = expected_parts(settings.train_workers)
    attempts: list[Attempt] = []
    finished_by = None
    for k in range(settings.max_attempts):
        pointer = read_pointer(save)
        if k and pointer is not None and pointer >= settings.num_rollout - 1:
            finished_by = "checkpoint"  # killed after the final save: nothing is left to train (resume refuses)
            break
        args = train_args(settings, model, train, plan.mode, run_dir / f"attempt_{k}", save, pointer is not None)
        a = run_attempt(k, args, run_dir / f"attempt_{k}", save, parts, settings, plan if k == 0 else None)
        attempts.append(a)
        print(
            f"  attempt {k}: loaded {a.loaded}, rc {a.returncode}, step {a.steps}/{settings.num_rollout}, "
            f"{a.seconds}s{', HANG' if a.hang else ''}",
            flush=True,
        )
        if a.hang:
            break
        if a.steps >= settings.num_rollout:
            finished_by = "metrics"
            break
    loaded = [a.loaded for a in attempts] + ([read_pointer(save)] if finished_by == "checkpoint" else [])
    rows = lineage([rollouts(a.out_dir) for a in attempts] + ([[]] if finished_by == "checkpoint" else []), loaded)
    exact = exactly_once_problems(rows, settings.num_rollout, settings.batch_size, settings.num_prompts)
    if plan.mode == "one-step-off":
        exact += replay_problems([rollouts(a.out_dir) for a in attempts], [a.loaded for a in attempts])
    pointer = [p for a in attempts for p in a.pointer_problems]
    left = [p for a in attempts for p in a.left_running]
    hang = any(a.hang for a in attempts)
    # An attempt that failed with no kill to explain it (attempt 0 before its kill, or a resume) is a failure too.
    crashed = [f"attempt {a.index} failed by itself: {a.error}" for a in attempts if a.error and a.kill is None]
    kill = attempts[0].kill if attempts else None
    return {
        "plan": plan.to_dict(),
        "kill": kill,
        "attempts": [dataclasses.asdict(a) for a in attempts],
        "exact": not exact and not hang,
        "exact_problems": exact,
        "pointer_complete": not pointer,
        "pointer_problems": pointer,
        "finished": finished_by is not None,
        "finished_by": finished_by,
        "left_running": left,
        "hang": hang,
        "crashed": crashed,
        "ok": not exact and not pointer and finished_by is not None and not left and not hang and not crashed,
    }


def table(results: list[dict]) -> str:
    def yes(v: bool) -> str:
        return "yes" if v else "**NO**"

    lines = [
        "| run | seed | mode | target | moment (plan) | kill landed | attempts (loaded: rc, steps) | exact | "
        "pointer complete | finished | left running | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, k = r["plan"], r["kill"]
        landed = (
            f"{k['seconds']}s, step {k['after_step']}" + (f", mid-save {k['in_save'][0]}" if k["in_save"] else "")
            if k
            else "not fired"
        )
        attempts = "; ".join(
            f"{'scratch' if a['loaded'] is None else a['loaded']}: "
            f"{'hang' if a['hang'] else a['returncode']}, {a['steps']}"
            + (" (before the kill)" if a["index"] == 0 and not r["kill"] and a["error"] else "")
            for a in r["attempts"]
        )
        left = len(r["left_running"]) or "none"
        lines.append(
            f"| {p['run']} | {p['seed']} | {p['mode']} | {p['target']} | {KillPlan(**p).describe()} | {landed} | "
            f"{attempts} | {yes(r['exact'])} | {yes(r['pointer_complete'])} | {yes(r['finished'])} | {left} | "
            f"{yes(r['ok'])} |"
        )
    failures = [
        f"- run {r['plan']['run']}: "
        + "; ".join(
            r["exact_problems"]
            + r["pointer_problems"]
            + r["left_running"]
            + (["hang"] if r["hang"] else [])
            + r["crashed"]
        )
        for r in results
        if not r["ok"]
    ]
    return "\n".join(lines + ([""] + failures if failures else []))


def soak(runs: int, seed: int, out: Path, settings: Settings, only: list[int] | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    model, train = make_assets(out, settings)
    plans = [p for p in plan_runs(seed, runs, settings.num_rollout) if only is None or p.run in only]
    results = []
    for plan in plans:
        print(f"run {plan.run} seed {seed}: {plan.mode}, SIGKILL {plan.describe()}", flush=True)
        run_dir = out / f"run_{plan.run:03d}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        results.append(soak_run(plan, settings, model, train, run_dir))
        print(f"  -> {'ok' if results[-1]['ok'] else 'FAILED'}", flush=True)
        report = {"settings": dataclasses.asdict(settings), "seed": seed, "runs": runs, "results": results}
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        (out / "soak.md").write_text(table(results) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help=f"how many runs (targets cycle: {', '.join(TARGETS)})")
    parser.add_argument("--seed", type=int, default=0, help=f"seeds each run's target, moment, mode {MODES}")
    parser.add_argument("--out", type=Path, required=True, help="folder for soak.json, soak.md and each run's files")
    parser.add_argument("--only", type=int, nargs="*", default=None, help="replay just these run indices")
    d = Settings()
    parser.add_argument("--num-rollout", type=int, default=d.num_rollout)
    parser.add_argument("--train-workers", type=int, default=d.train_workers)
    parser.add_argument("--engines", type=int, default=d.engines)
    parser.add_argument("--save-pause", type=float, default=d.save_pause, help="seconds each save is held open")
    parser.add_argument("--attempt-timeout", type=float, default=d.attempt_timeout, help="an attempt past it hangs")
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts)
    parser.add_argument("--poll", type=float, default=d.poll, help="seconds between pointer checks")
    parser.add_argument("extra", nargs="*", help="after --: more train_async.py flags for every attempt")
    ns = parser.parse_args(argv)
    settings = Settings(
        num_rollout=ns.num_rollout,
        train_workers=ns.train_workers,
        engines=ns.engines,
        save_pause=ns.save_pause,
        attempt_timeout=ns.attempt_timeout,
        max_attempts=ns.max_attempts,
        poll=ns.poll,
        extra_args=tuple(ns.extra),
    )
    results = soak(ns.runs, ns.seed, ns.out, settings, ns.only)
    print(table(results), flush=True)
    print(f"\n{sum(r['ok'] for r in results)}/{len(results)} runs ok; details: {ns.out / 'soak.json'}", flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
