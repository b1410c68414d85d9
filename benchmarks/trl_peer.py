"""TRL's GRPOTrainer as a peer: the quickstart run by ``train_async.py`` and by TRL, side by side, one invocation.

    python -m benchmarks.trl_peer [--steps 30] [--eval-interval 5] [--seeds S ...] [--out DIR] [-- LAUNCHER FLAGS]
    python -m benchmarks.run --only trl_peer [--quick]

TRL (pinned in benchmarks/requirements-trl.txt) lives in its own cached environment
(scripts/setup_trl_env.sh). The quickstart's assets are prepared as scripts/quickstart.sh does; then
our launcher (scripts/run-smollm2-cpu-async.sh) runs, and after it benchmarks/trl_grpo_runner.py with
every setting taken from that launcher's own command line (its ``--dry-run``, read by our parser), so
the two cannot drift apart: same model, prompts, group size, response length, learning rate, seed,
held-out eval and reward. Both train on the same prompts at every step: ours draws them from its data
source (--rollout-seed), and TRL's runner gets that sequence in order; each run's own record of what it
drew (our rollouts.jsonl, TRL's steps.jsonl) is checked against it. Flags after ``--`` go to our
launcher, and so through its ``--dry-run`` to TRL's runner as well (``-- --lr-decay-iters 60`` runs both
on the cosine of a 60-step run). The runner's docstring lists what TRL cannot match (it is on-policy and
synchronous; ours is one step off with TIS).
``-- --synchronous`` runs ours on-policy as TRL is, generation and training taking turns on all the cores.

One run of each differs from the next by its seed as much as by its code: the held-out set is 60 prompts
over 9 facts (4 or 8 prompts each), so one fact learnt or lost moves it by 7 or 13 points. ``--seeds 1 2
3`` runs both once per seed (our --seed and --rollout-seed, which TRL's runner follows: its own --seed and
our prompt order) and sums them up as their mean curves; each seed's raw result is written to
``--out``/seed-S.json as it ends, and ``--from-results`` sums up such files again without running anything.

Reported: seconds per step (median, mean) and their ratio; held-out accuracy against training wall
time for both (ours from its first rollout, evals in the background; TRL's with its in-process
evals taken out of the clock); final accuracies; and for each run's final accuracy, the wall time
both take to first reach it at an eval after step 0 (None when never reached) and the speed-up.
``python -m benchmarks.run --only trl_peer`` runs the README's row: 30 steps with an eval every 5, ours
``--synchronous --lr-decay-iters 60``, seeds 1, 2 and 3 (about an hour on 2 cores); ``--quick``, a 2-step
smoke run of each with an eval every step. ``python -m benchmarks.trl_peer`` alone defaults to one run of
each of the quickstart as it is (one-step-off), 30 steps with an eval every 5.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, eval_curve, step_seconds
from benchmarks.trl_peer_report import Curve, headline, summarize, summarize_seeds
from miles_async.config import precision

LAUNCHER = ROOT / "scripts" / "run-smollm2-cpu-async.sh"
RUNNER = ROOT / "benchmarks" / "trl_grpo_runner.py"
EVAL_KEY = "eval/mul/accuracy"
# Each side's per-step trace of its update (TRL's logged name -> ours in metrics.jsonl), kept beside the rewards so
# that two runs learning at different speeds can be told apart by what their steps did.
UPDATE_TRACE = {"grad_norm": "train/grad_norm", "learning_rate": "train/lr", "entropy": "train/entropy"}
FULL = (30, 5)  # steps, eval interval
QUICK = (2, 1)
# The full run behind the README's row: our on-policy loop (TRL's), the cosine of a 60-step run, three seeds.
FULL_LAUNCHER_ARGS = ("--lr-decay-iters", "60", "--synchronous")
FULL_SEEDS = (1, 2, 3)


# ---- the quickstart's settings, translated for TRL (pure) ----


def launcher_argv(dry_run_output: str) -> list[str]:
    """train_async.py's flags from the launcher's ``--dry-run`` output (the command minus python and script)."""
    # Each flag sits on a continuation line ("\\\n"), which shlex would keep as a word of its own.
    words = shlex.split(dry_run_output.replace("\\\n", " "))
    for i, w in enumerate(words):
        if w.endswith("train_async.py"):
            return words[i + 1 :]
    raise ValueError(f"no train_async.py in the launcher's --dry-run output:\n{dry_run_output[:2000]}")


def launcher_namespace(flags: Sequence[str], env: dict[str, str]) -> argparse.Namespace:
    """Our parser's namespace for the quickstart launcher's command with ``flags`` appended, read from its
    ``--dry-run`` (``env``: its MODEL, DATA and OUT)."""
    proc = subprocess.run(
        ["bash", str(LAUNCHER), *flags, "--dry-run"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the launcher's --dry-run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return parse_ours(launcher_argv(proc.stdout))


def parse_ours(argv: Sequence[str]) -> argparse.Namespace:
    """Our parser's namespace for ``argv``, defaults included (unvalidated: paths need not exist)."""
    from miles_async.arguments import build_parser

    ns, _ = build_parser().parse_known_args(list(argv))
    return ns


def loop_mode(ns: argparse.Namespace) -> str:
    """Our loop as the launcher's flags chose it."""
    return "synchronous" if ns.synchronous else "fully-async" if ns.fully_async else "one-step-off"


def peer_args(ns: argparse.Namespace) -> list[str]:
    """trl_grpo_runner.py's flags for our settings ``ns``; raises ValueError for one TRL's runner cannot match."""
    unsupported = {
        "--advantage-estimator": (ns.advantage_estimator, "grpo"),
        "--optimizer": (ns.optimizer, "adam"),
        "--lr-warmup-iters": (ns.lr_warmup_iters, 0),
        "--loss-agg-mode": (ns.loss_agg_mode, "token_mean"),
        "--policy-loss-type": (ns.policy_loss_type or "ppo", "ppo"),
        "--global-batch-size": (ns.global_batch_size, None),
        "--num-steps-per-rollout": (ns.num_steps_per_rollout, None),
    }
    for name, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(f"{name} {value}: the TRL peer runs only {wanted} (as the quickstart)")
    if not ns.apply_chat_template:
        raise ValueError("the TRL peer sends chat prompts: the quickstart's --apply-chat-template is expected")
    if ns.eval_interval is None or not ns.eval_prompt_data:
        raise ValueError("the TRL peer compares held-out accuracy: give --eval-prompt-data and --eval-interval")
    if ns.lr_decay_style not in ("constant", "cosine"):
        raise ValueError(f"--lr-decay-style {ns.lr_decay_style}: the TRL peer runs constant or cosine")
    if ns.lr_decay_iters is not None and ns.lr_decay_iters < ns.num_rollout:
        # Ours holds --min-lr after the span; HF's cosine would climb back.
        raise ValueError(
            f"--lr-decay-iters {ns.lr_decay_iters}: the TRL peer's cosine must span the run (--num-rollout "
            f"{ns.num_rollout}) or more"
        )
    trl_precision = "bf16" if ns.bf16 else "float32"
    if ns.rollout_dtype not in (None, "bfloat16" if ns.bf16 else "float32"):
        raise ValueError(
            f"--rollout-dtype {ns.rollout_dtype} with{'' if ns.bf16 else 'out'} --bf16: the TRL peer generates and "
            "trains at one precision"
        )
    kl = ns.kl_loss_coef if ns.use_kl_loss else 0.0
    flags: dict[str, Any] = {
        "--steps": ns.num_rollout,
        "--eval-interval": ns.eval_interval,
        "--lr": ns.lr,
        "--lr-schedule": ns.lr_decay_style,
        "--min-lr": ns.min_lr,
        "--seed": ns.seed,
        "--prompts-per-step": ns.rollout_batch_size,
        "--num-generations": ns.n_samples_per_prompt,
        "--max-completion-length": ns.rollout_max_response_len,
        "--temperature": ns.rollout_temperature,
        "--top-p": ns.rollout_top_p,
        "--top-k": max(ns.rollout_top_k, 0),  # ours: -1 = off; TRL's: 0 = off
        "--epsilon": ns.eps_clip,
        "--beta": kl,
        "--entropy-coef": ns.entropy_coef,
        "--scale-rewards": "none" if ns.disable_grpo_std_normalization else "group",
        "--max-tokens-per-micro-batch": ns.max_tokens_per_gpu,
        "--max-grad-norm": ns.clip_grad,
        "--adam-beta1": ns.adam_beta1,
        "--adam-beta2": ns.adam_beta2,
        "--adam-eps": ns.adam_eps,
        "--weight-decay": ns.weight_decay,
        "--precision": trl_precision,
        "--eval-samples": ns.n_samples_per_eval_prompt,
        "--eval-temperature": ns.eval_temperature,
        "--eval-top-p": ns.eval_top_p,
        "--eval-max-new-tokens": ns.eval_max_response_len or ns.rollout_max_response_len,
    }
    if ns.eps_clip_high is not None:
        flags["--epsilon-high"] = ns.eps_clip_high
    if ns.lr_decay_iters is not None:
        flags["--lr-decay-iters"] = ns.lr_decay_iters
    return [x for k, v in flags.items() for x in (k, str(v))]


def prompt_sequence(ns: argparse.Namespace) -> list[dict]:
    """Our run's training prompts, step after step, as our data source hands them out (--rollout-seed):
    TRL's runner trains on the same prompts at every step (``--in-order``)."""
    from miles_async.config import rollout
    from miles_async.rollout.data_source import DataSource

    cfg = rollout.build(ns, None)
    # Each of these draws a step's prompts otherwise than one batch of the data source per step.
    for name, value in (
        ("--data-source-path", cfg.data_source_path),
        ("--rollout-max-prompt-len", cfg.data.max_prompt_len),
        ("--dynamic-sampling-filter-path / --zero-variance-filter", cfg.dynamic_sampling),
    ):
        if value is not None:
            raise ValueError(f"{name}: the TRL peer gives TRL our prompt order, one batch of the data source a step")
    source = DataSource(cfg.data, ns.rollout_batch_size)
    return [
        {"uid": item.uid, "prompt": item.prompt, "label": item.label}
        for _ in range(ns.num_rollout)
        for item in source.next_batch()
    ]


def check_same_prompts(whose: str, sequence: list[dict], batch: int, drawn: list[list[str]], key: str) -> None:
    """Raise ValueError at the first step where ``whose`` run trained on other prompts than ``sequence``, the
    order both runs follow: ``drawn`` holds each step's ``key`` (our rollouts.jsonl's uids, TRL's steps.jsonl
    prompts). Within a step the order does not matter: the step's one optimizer step sees them all."""
    steps = [sequence[i : i + batch] for i in range(0, len(sequence), batch)]
    if len(drawn) != len(steps):
        raise ValueError(f"{whose} trained {len(drawn)} steps; the prompt order has {len(steps)}")
    for step, (got, meant) in enumerate(zip(drawn, steps, strict=True), 1):
        if sorted(got) != sorted(r[key] for r in meant):
            raise ValueError(f"{whose}, step {step}: trained on {sorted(got)}, not {sorted(r[key] for r in meant)}")


# ---- curves and comparisons (pure) ----


def mixed_version_evals(evals: list[dict], key: str = "eval/mul") -> list[list[int]]:
    """[step, first, last weight version] of our background evals whose weights changed while they ran."""
    out = []
    for e in sorted(evals, key=lambda e: e["step"]):
        lo, hi = e.get(f"{key}/weight_version_min"), e.get(f"{key}/weight_version_max")
        if lo is not None and hi is not None and lo != hi:
            out.append([e["step"], lo, hi])
    return out


def trl_curve(evals: list[dict]) -> Curve:
    return [(e["step"], e["accuracy"], e["train_seconds"]) for e in sorted(evals, key=lambda e: e["step"])]


def seed_args(seed: int) -> list[str]:
    """Our launcher's flags for one seed of a multi-seed run: sampling and initialisation (--seed) and the
    prompt order (--rollout-seed), which TRL's runner then follows too."""
    return ["--seed", str(seed), "--rollout-seed", str(seed)]


# ---- running the two (I/O) ----


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise RuntimeError(f"{path} was not written")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)


def _run(cmd: list[str], log: Path, timeout: float, what: str, env: dict[str, str]) -> str:
    print(f"[trl_peer] {what} (log: {log})", file=sys.stderr, flush=True)
    with log.open("w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=fh, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{what} ran past {timeout:.0f} s; log {log}") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{log.read_text()[-4000:]}")
    return proc.stdout


def _cache() -> Path:
    return Path(os.environ.get("MILES_ASYNC_CACHE", Path.home() / ".cache" / "miles-async"))


def trl_python() -> Path:
    """The TRL environment's python, built once by scripts/setup_trl_env.sh."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_trl_env.sh")], capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/setup_trl_env.sh failed:\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def prepare_assets() -> tuple[Path, Path]:
    """The quickstart's model and data, exactly as scripts/quickstart.sh prepares them."""
    cache = _cache()
    model = subprocess.run(
        [sys.executable, "-m", "miles_async.assets.smollm2", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=_env(),
        cwd=ROOT,
    )
    if model.returncode != 0:
        raise RuntimeError(f"preparing SmolLM2 failed:\n{model.stderr[-4000:]}")
    data = cache / "data" / "mul"
    subprocess.run(
        [sys.executable, "-m", "miles_async.assets.arith_dataset", "--task", "mul", "--out", str(data)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=ROOT,
        check=True,
    )
    return Path(model.stdout.strip().splitlines()[-1]), data


def _timed(cmd: list[str], log: Path, timeout: float, what: str, env: dict, load: list[float]) -> float:
    """``_run`` with its wall seconds returned and the 1-minute load average before and after put in ``load``."""
    load.append(round(os.getloadavg()[0], 1))
    t = time.perf_counter()
    _run(cmd, log, timeout, what, env)
    load.append(round(os.getloadavg()[0], 1))
    return time.perf_counter() - t


def run_both(
    steps: int,
    interval: int,
    work: Path,
    launcher_args: Sequence[str] = (),
    data: Path | None = None,
    trl_steps: int | None = None,
) -> dict:
    """One run of ours, then TRL's on the same prompts; ``data``: a train/eval.jsonl folder other than the
    quickstart's (the shape set's longer prompts); ``trl_steps``: TRL runs only the first this many of our steps'
    prompts (where its steps take many minutes each)."""
    python = trl_python()
    model, quickstart_data = prepare_assets()
    data = data or quickstart_data
    ours_out, trl_out = work / "ours", work / "trl"
    env = _env(MODEL=str(model), DATA=str(data), OUT=str(ours_out), PYTHON=sys.executable)
    flags = ["--num-rollout", str(steps), "--eval-interval", str(interval), "--no-plot", *launcher_args]
    launcher = ["bash", str(LAUNCHER), *flags]
    ns = launcher_namespace(flags, env)
    # Our run's precision as it resolves on this machine (bf16 only where the CPU computes it): TRL's follows.
    ns, _ = precision.fall_back(ns, on_gpu=False, has_bf16=precision.cpu_has_bf16())
    trl_flags = peer_args(ns)
    n_trl = steps if trl_steps is None else trl_steps
    trl_flags[trl_flags.index("--steps") + 1] = str(n_trl)
    timeout = 600 + 600 * steps
    load: dict[str, list[float]] = {"ours": [], "trl": []}
    ours_wall = _timed(launcher, work / "ours.log", timeout, f"train_async.py, {steps} steps", env, load["ours"])
    metrics, evals = _jsonl(ours_out / "metrics.jsonl"), _jsonl(ours_out / "eval.jsonl")
    # --synchronous runs its evals between steps, in its clock; TRL's runner takes its own out: so are ours.
    ours = {
        "step_seconds": step_seconds(metrics, ns.synchronous),
        "curve": eval_curve(metrics, evals, EVAL_KEY, ns.synchronous),
    }
    ours["mixed_version_evals"] = mixed_version_evals(evals)
    sequence = prompt_sequence(ns)
    uids = [r["uids"] for r in _jsonl(ours_out / "rollouts.jsonl")]
    check_same_prompts("our run", sequence, ns.rollout_batch_size, uids, "uid")
    ordered = work / "train_in_our_order.jsonl"
    ordered.write_text("".join(json.dumps(r) + "\n" for r in sequence))
    cmd = [str(python), str(RUNNER), "--model", str(model), "--train", str(ordered), "--in-order"]
    cmd += ["--eval", str(data / "eval.jsonl"), "--out", str(trl_out), *trl_flags]
    # A shape whose TRL steps run fewer (they take many minutes each) gets their time, not ours.
    trl_timeout = 600 + 1800 * n_trl if n_trl < steps else timeout
    trl_wall = _timed(cmd, work / "trl.log", trl_timeout, f"TRL GRPOTrainer, {n_trl} steps", env, load["trl"])
    trl_records, trl_evals = _jsonl(trl_out / "steps.jsonl"), _jsonl(trl_out / "evals.jsonl")
    trl = {
        "step_seconds": [r["step_seconds"] for r in trl_records],
        "curve": trl_curve(trl_evals),
        "response_len_mean": [r.get("completion_mean_length") for r in trl_records],
        **{key: [r.get(key) for r in trl_records] for key in UPDATE_TRACE},
    }
    trl_sequence = sequence[: n_trl * ns.rollout_batch_size]
    check_same_prompts("TRL", trl_sequence, ns.rollout_batch_size, [r["prompts"] for r in trl_records], "prompt")
    version = subprocess.run(
        [str(python), "-c", "import trl, transformers; print(trl.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    return {
        "ours": {
            **ours,
            "process_seconds": ours_wall,
            "reward_mean": [r.get("rollout/reward_mean") for r in metrics],
            "response_len_mean": [r.get("rollout/response_len_mean") for r in metrics],
            **{key: [r.get(ours_key) for r in metrics] for key, ours_key in UPDATE_TRACE.items()},
        },
        "trl": {**trl, "process_seconds": trl_wall, "reward_mean": [r["reward_mean"] for r in trl_records]},
        "launcher_args": list(launcher_args),
        "mode": loop_mode(ns),
        "trl_flags": trl_flags,
        "trl_version": version[0] if version else None,
        "trl_transformers_version": version[1] if len(version) > 1 else None,
        "load_average_per_run": load,
    }


def run_kept(
    steps: int,
    interval: int,
    launcher_args: Sequence[str],
    data: Path | None = None,
    trl_steps: int | None = None,
) -> dict:
    """``run_both`` in a scratch folder, removed after a success and kept (with both runs' logs) after a failure."""
    work = Path(tempfile.mkdtemp(prefix="miles_async_trl_peer_"))
    try:
        raw = run_both(steps, interval, work, launcher_args, data, trl_steps)
    except Exception:
        print(f"[trl_peer] failed; logs kept in {work}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return raw


def measure(
    steps: int,
    interval: int,
    out_dir: Path,
    launcher_args: Sequence[str] = (),
    seeds: Sequence[int] = (),
    seed_dir: Path | None = None,
) -> dict:
    """One run of each with the launcher's own seed; or, with ``seeds``, one of each per seed, every seed's
    raw result written to ``seed_dir`` (default ``out_dir``)/seed-S.json as it ends (``--from-results`` sums
    up what a cut run left)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not seeds:
        return summarize(steps, interval, run_kept(steps, interval, launcher_args), out_dir)
    seed_dir = seed_dir or out_dir
    seed_dir.mkdir(parents=True, exist_ok=True)
    raws = {}
    for seed in seeds:
        raws[str(seed)] = run_kept(steps, interval, [*launcher_args, *seed_args(seed)])
        (seed_dir / f"seed-{seed}.json").write_text(json.dumps(raws[str(seed)], indent=1) + "\n")
    return summarize_seeds(steps, interval, raws, out_dir)


def run(quick: bool, out_dir: Path) -> dict:
    """benchmarks.run's entry: quick, one 2-step run of each; full, the README's row (FULL_LAUNCHER_ARGS over
    FULL_SEEDS), the seeds' raw results kept in ``out_dir``/trl_peer_seeds."""
    if quick:
        return measure(*QUICK, out_dir)
    return measure(*FULL, out_dir, FULL_LAUNCHER_ARGS, FULL_SEEDS, out_dir / "trl_peer_seeds")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import machine_info, render_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=FULL[0], help="steps for both (our --num-rollout)")
    ap.add_argument("--eval-interval", type=int, default=FULL[1], help="held-out eval every this many steps")
    ap.add_argument("--out", type=Path, default=Path("outputs/trl_peer"), help="where results.json and the plot go")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[],
        help="one run of each per seed (our --seed and --rollout-seed, followed by TRL), summed up as their mean",
    )
    ap.add_argument(
        "--from-results",
        type=Path,
        nargs="+",
        default=[],
        metavar="SEED_JSON",
        help="sum up seed-S.json files an earlier --seeds run wrote, running nothing (--steps and "
        "--eval-interval must be theirs)",
    )
    ap.add_argument(
        "launcher_args", nargs="*", help="after --: flags for our launcher, which TRL's runner then follows too"
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.eval_interval < 1:
        ap.error("--steps and --eval-interval must be at least 1")
    given = sorted({"--seed", "--rollout-seed"} & set(args.launcher_args))
    if given and args.seeds:
        ap.error(f"--seeds sets our --seed and --rollout-seed: leave {' and '.join(given)} out of the launcher flags")
    load_before = os.getloadavg()[0]
    if args.from_results:
        raws = {}
        for path in args.from_results:
            if not path.name.startswith("seed-") or path.suffix != ".json":
                ap.error(f"--from-results {path}: expected a seed-S.json written by a --seeds run")
            raw = json.loads(path.read_text())
            ran = {len(raw[name]["step_seconds"]) for name in ("ours", "trl")}
            if ran != {args.steps}:
                ap.error(f"--from-results {path}: its runs took {sorted(ran)} steps, not --steps {args.steps}")
            raws[path.stem.removeprefix("seed-")] = raw
        args.out.mkdir(parents=True, exist_ok=True)
        entry = summarize_seeds(args.steps, args.eval_interval, raws, args.out)
    else:
        entry = measure(args.steps, args.eval_interval, args.out, args.launcher_args, args.seeds)
    entry = {
        "machine": machine_info(),
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        **entry,
    }
    (args.out / "results.json").write_text(json.dumps(entry, indent=1) + "\n")
    for t in entry["tables"]:
        print(render_table(t), "\n")
    for what, result in headline(entry):
        print(f"{what}: {result}")
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
