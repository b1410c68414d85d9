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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, eval_curve, median, step_seconds, table, time_to_reach
from miles_async.config import precision

LAUNCHER = ROOT / "scripts" / "run-smollm2-cpu-async.sh"
RUNNER = ROOT / "benchmarks" / "trl_grpo_runner.py"
EVAL_KEY = "eval/mul/accuracy"
FULL = (30, 5)  # steps, eval interval
QUICK = (2, 1)
# The full run behind the README's row: our on-policy loop (TRL's), the cosine of a 60-step run, three seeds.
FULL_LAUNCHER_ARGS = ("--lr-decay-iters", "60", "--synchronous")
FULL_SEEDS = (1, 2, 3)

Curve = list[tuple[int, float, float]]  # (step, accuracy, training wall seconds when the eval's weights were ready)


# ---- the quickstart's settings, translated for TRL (pure) ----


def launcher_argv(dry_run_output: str) -> list[str]:
    """train_async.py's flags from the launcher's ``--dry-run`` output (the command minus python and script)."""
    # Each flag sits on a continuation line ("\\\n"), which shlex would keep as a word of its own.
    words = shlex.split(dry_run_output.replace("\\\n", " "))
    for i, w in enumerate(words):
        if w.endswith("train_async.py"):
            return words[i + 1 :]
    raise ValueError(f"no train_async.py in the launcher's --dry-run output:\n{dry_run_output[:2000]}")


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


def ratio(slow: float | None, fast: float | None) -> float | None:
    """``slow / fast``, None when either is missing or ``fast`` is not positive."""
    if slow is None or fast is None or fast <= 0:
        return None
    return slow / fast


def step_stats(seconds: Sequence[float]) -> dict[str, float]:
    return {"median": median(seconds), "mean": float(statistics.fmean(seconds))}


def compare(ours: dict, trl: dict) -> dict:
    """The comparison of two runs, each {"step_seconds": [...], "curve": Curve}."""
    out: dict[str, Any] = {}
    for name, r in (("ours", ours), ("trl", trl)):
        out[name] = {
            **step_stats(r["step_seconds"]),
            "initial_accuracy": r["curve"][0][1],
            "final_accuracy": r["curve"][-1][1],
        }
    out["step_ratio_median"] = ratio(out["trl"]["median"], out["ours"]["median"])
    out["step_ratio_mean"] = ratio(out["trl"]["mean"], out["ours"]["mean"])
    out["levels"] = []
    for whose in ("trl", "ours"):
        level = out[whose]["final_accuracy"]
        hit_ours, hit_trl = time_to_reach(ours["curve"], level), time_to_reach(trl["curve"], level)
        t_ours, t_trl = (hit_ours[1] if hit_ours else None), (hit_trl[1] if hit_trl else None)
        out["levels"].append(
            {
                "level": level,
                "of": whose,
                "ours_seconds": t_ours,
                "ours_step": hit_ours[0] if hit_ours else None,
                "trl_seconds": t_trl,
                "trl_step": hit_trl[0] if hit_trl else None,
                "speedup": ratio(t_trl, t_ours),
            }
        )
    return out


def seed_args(seed: int) -> list[str]:
    """Our launcher's flags for one seed of a multi-seed run: sampling and initialisation (--seed) and the
    prompt order (--rollout-seed), which TRL's runner then follows too."""
    return ["--seed", str(seed), "--rollout-seed", str(seed)]


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """Accuracy and wall seconds averaged over runs, at every eval step all of them have."""
    by_run = [{s: (a, t) for s, a, t in c} for c in curves]
    steps = sorted(set.intersection(*(set(b) for b in by_run)))
    return [(s, statistics.fmean(b[s][0] for b in by_run), statistics.fmean(b[s][1] for b in by_run)) for s in steps]


def pooled(runs: Sequence[dict]) -> dict:
    """One run standing for several seeds of one side: step times pooled, curves averaged."""
    return {
        "step_seconds": [x for r in runs for x in r["step_seconds"]],
        "curve": mean_curve([r["curve"] for r in runs]),
    }


def accuracy_range(curves: Sequence[Curve]) -> dict[int, tuple[float, float]]:
    """(lowest, highest) accuracy over runs at each eval step."""
    out: dict[int, tuple[float, float]] = {}
    for c in curves:
        for s, a, _ in c:
            lo, hi = out.get(s, (a, a))
            out[s] = (min(lo, a), max(hi, a))
    return out


def _s(x: float | None, step: int | None = None) -> str:
    if x is None:
        return "not reached"
    return f"{x:.0f} s" + (f" (step {step})" if step is not None else "")


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _run_cells(r: dict) -> list[str]:
    return [f"{r['median']:.1f}", f"{r['mean']:.1f}", f"{r['initial_accuracy']:.3f}", f"{r['final_accuracy']:.3f}"]


def tables(
    cmp: dict,
    curves: dict[str, Curve],
    what: str,
    mode: str = "one-step-off",
    ranges: dict[str, dict[int, tuple[float, float]]] | None = None,
) -> list[dict]:
    """Step times, time to the peer's final accuracy, and the curves; ``ranges``: with several seeds, the
    curves are their means and each accuracy shows its lowest and highest seed."""
    o, t = cmp["ours"], cmp["trl"]
    steps = table(
        f"Seconds per step, train_async.py vs TRL GRPOTrainer: {what}",
        ["run", "median s/step", "mean s/step", "accuracy before", "accuracy at the end"],
        [
            [f"train_async.py ({mode})", *_run_cells(o)],
            ["TRL GRPOTrainer", *_run_cells(t)],
            ["TRL / ours", _x(cmp["step_ratio_median"]), _x(cmp["step_ratio_mean"]), "", ""],
        ],
        "TRL's step time excludes its held-out evals (run in-process between steps); "
        + (
            "so does ours (--synchronous runs them between steps too)"
            if mode == "synchronous"
            else "ours include whatever the background evals cost the step"
        ),
    )
    reach = table(
        "Wall time to reach the peer's final held-out accuracy",
        ["level", "train_async.py", "TRL GRPOTrainer", "speed-up (TRL / ours)"],
        [
            [
                f"{lv['level']:.3f} ({'TRL' if lv['of'] == 'trl' else 'our'} final)",
                _s(lv["ours_seconds"], lv["ours_step"]),
                _s(lv["trl_seconds"], lv["trl_step"]),
                _x(lv["speedup"]),
            ]
            for lv in cmp["levels"]
        ],
        "first eval after step 0 at or above the level; wall time of training from the first step, when that "
        "eval's weights were ready",
    )
    steps_seen = sorted({s for c in curves.values() for s, _, _ in c})
    by_step = {name: {s: (a, sec) for s, a, sec in c} for name, c in curves.items()}
    rows = []
    for s in steps_seen:
        row: list[Any] = [s]
        for name in ("ours", "trl"):
            a, sec = by_step[name].get(s, (None, None))
            cell = "-" if a is None else f"{a:.3f}"
            if a is not None and ranges is not None:
                cell += " ({:.3f}-{:.3f})".format(*ranges[name][s])
            row += [cell, "-" if sec is None else f"{sec:.0f}"]
        rows.append(row)
    curve = table(
        "Held-out accuracy against training wall time" + (", mean of the seeds (lowest-highest)" if ranges else ""),
        ["step", "ours accuracy", "ours s", "TRL accuracy", "TRL s"],
        rows,
    )
    return [steps, reach, curve]


def headline(entry: dict) -> list[list[str]]:
    c = entry["comparison"]
    mode = entry.get("results", {}).get("mode", "one-step-off")  # runs before the mode was recorded: the default
    what = f"TRL GRPOTrainer peer, SmolLM2 quickstart, {entry['steps']} steps, ours {mode}"
    if entry.get("seeds"):
        what += f", seed {entry['seeds'][0]}" if len(entry["seeds"]) == 1 else f", mean of {len(entry['seeds'])} seeds"
    rows = [
        [
            f"{what}: seconds per step, train_async.py vs TRL (median)",
            f"{c['ours']['median']:.1f} s vs {c['trl']['median']:.1f} s ({_x(c['step_ratio_median'])})",
        ]
    ]
    finals = f"final accuracy {c['ours']['final_accuracy']:.2f} vs {c['trl']['final_accuracy']:.2f}"
    lv = next(lv for lv in c["levels"] if lv["of"] == "trl")
    if lv["speedup"] is None:
        result = f"ours {_s(lv['ours_seconds'])}, TRL {_s(lv['trl_seconds'])}; {finals} (goal: 3x)"
    else:
        result = f"{lv['ours_seconds']:.0f} s vs {lv['trl_seconds']:.0f} s ({lv['speedup']:.2f}x); {finals} (goal: 3x)"
    rows.append([f"{what}: wall time to TRL's final held-out accuracy ({lv['level']:.2f}), ours vs TRL", result])
    return rows


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


def run_both(steps: int, interval: int, work: Path, launcher_args: Sequence[str] = ()) -> dict:
    python = trl_python()
    model, data = prepare_assets()
    ours_out, trl_out = work / "ours", work / "trl"
    env = _env(MODEL=str(model), DATA=str(data), OUT=str(ours_out), PYTHON=sys.executable)
    flags = ["--num-rollout", str(steps), "--eval-interval", str(interval), "--no-plot", *launcher_args]
    launcher = ["bash", str(LAUNCHER), *flags]
    ns = parse_ours(launcher_argv(_run([*launcher, "--dry-run"], work / "dry_run.log", 60, "launcher --dry-run", env)))
    # Our run's precision as it resolves on this machine (bf16 only where the CPU computes it): TRL's follows.
    ns, _ = precision.fall_back(ns, on_gpu=False, has_bf16=precision.cpu_has_bf16())
    trl_flags = peer_args(ns)
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
    trl_wall = _timed(cmd, work / "trl.log", timeout, f"TRL GRPOTrainer, {steps} steps", env, load["trl"])
    trl_steps, trl_evals = _jsonl(trl_out / "steps.jsonl"), _jsonl(trl_out / "evals.jsonl")
    trl = {"step_seconds": [r["step_seconds"] for r in trl_steps], "curve": trl_curve(trl_evals)}
    check_same_prompts("TRL", sequence, ns.rollout_batch_size, [r["prompts"] for r in trl_steps], "prompt")
    version = subprocess.run(
        [str(python), "-c", "import trl, transformers; print(trl.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    return {
        "ours": {**ours, "process_seconds": ours_wall, "reward_mean": [r.get("rollout/reward_mean") for r in metrics]},
        "trl": {**trl, "process_seconds": trl_wall, "reward_mean": [r["reward_mean"] for r in trl_steps]},
        "launcher_args": list(launcher_args),
        "mode": loop_mode(ns),
        "trl_flags": trl_flags,
        "trl_version": version[0] if version else None,
        "trl_transformers_version": version[1] if len(version) > 1 else None,
        "load_average_per_run": load,
    }


def _plot(runs: dict[str, list[Curve]], out_dir: Path, mode: str) -> list[str]:
    """Held-out accuracy against wall time: each side's mean over its runs, and each run faintly when several."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label, color in (("ours", f"train_async.py ({mode})", "C0"), ("trl", "TRL GRPOTrainer", "C1")):
        if len(runs[name]) > 1:
            label += f", mean of {len(runs[name])} seeds"
            for c in runs[name]:
                ax.plot([s for _, _, s in c], [a for _, a, _ in c], color=color, alpha=0.25, linewidth=1)
        c = mean_curve(runs[name])
        ax.plot([s for _, _, s in c], [a for _, a, _ in c], marker="o", color=color, label=label)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("SmolLM2 quickstart: train_async.py vs TRL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "trl_peer.png", dpi=100)
    plt.close(fig)
    return ["trl_peer.png"]


def run_kept(steps: int, interval: int, launcher_args: Sequence[str]) -> dict:
    """``run_both`` in a scratch folder, removed after a success and kept (with both runs' logs) after a failure."""
    work = Path(tempfile.mkdtemp(prefix="miles_async_trl_peer_"))
    try:
        raw = run_both(steps, interval, work, launcher_args)
    except Exception:
        print(f"[trl_peer] failed; logs kept in {work}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return raw


def _notes(raw: dict) -> list[str]:
    return [
        f"TRL {raw['trl_version']} (transformers {raw['trl_transformers_version']}) in its own environment, "
        "on-policy and synchronous (generation with transformers in the trainer's process); train_async.py "
        + (
            "synchronous too (on-policy, the engine generating with the weights it then trains)"
            if raw["mode"] == "synchronous"
            else f"{raw['mode']} with TIS"
        )
        + f". Both on the CPU in {_precision(raw)}, run one after the other on the same machine, on the same "
        "prompts at every step (ours in its --rollout-seed order, given to TRL as is).",
        f"Our launcher's extra flags: {' '.join(raw['launcher_args']) or 'none'}; TRL runner flags, derived "
        f"from the quickstart launcher: {' '.join(raw['trl_flags'])}",
    ] + (
        [
            "Our evals run in the background while training goes on; these saw the weights change mid-eval "
            "(step: first..last weight version): "
            + ", ".join(f"{s}: {lo}..{hi}" for s, lo, hi in raw["ours"]["mixed_version_evals"])
        ]
        if raw["ours"]["mixed_version_evals"]
        else []
    )


def _precision(raw: dict) -> str:
    flags = raw["trl_flags"]
    if "--precision" not in flags:  # runs before TRL followed our precision: both float32
        return "float32"
    return {"bf16": "bf16 mixed precision", "float32": "float32"}[flags[flags.index("--precision") + 1]]


def _what(steps: int, interval: int) -> str:
    return f"SmolLM2-135M quickstart (multiplication), {steps} steps of 8 prompts x 8, eval every {interval}"


def summarize(steps: int, interval: int, raw: dict, out_dir: Path) -> dict:
    """The entry of one run of each."""
    curves = {"ours": raw["ours"]["curve"], "trl": raw["trl"]["curve"]}
    cmp = compare(raw["ours"], raw["trl"])
    return {
        "steps": steps,
        "eval_interval": interval,
        "results": raw,
        "comparison": cmp,
        "tables": tables(cmp, curves, _what(steps, interval), raw["mode"]),
        "plots": _plot({k: [c] for k, c in curves.items()}, out_dir, raw["mode"]),
        "notes": _notes(raw),
    }


def seed_table(per_seed: dict[str, dict]) -> dict:
    rows = []
    for seed, c in per_seed.items():
        lv = next(lv for lv in c["levels"] if lv["of"] == "trl")
        rows.append(
            [
                seed,
                f"{c['ours']['median']:.1f}",
                f"{c['trl']['median']:.1f}",
                _x(c["step_ratio_median"]),
                f"{c['ours']['final_accuracy']:.3f}",
                f"{c['trl']['final_accuracy']:.3f}",
                _s(lv["ours_seconds"], lv["ours_step"]),
                _s(lv["trl_seconds"], lv["trl_step"]),
                _x(lv["speedup"]),
            ]
        )
    return table(
        "Each seed on its own",
        [
            "seed",
            "ours s/step",
            "TRL s/step",
            "TRL / ours",
            "ours final",
            "TRL final",
            "ours to TRL's final",
            "TRL to its final",
            "speed-up",
        ],
        rows,
        "medians; a seed sets both runs' sampling and initialisation and the prompt order they share",
    )


def summarize_seeds(steps: int, interval: int, raws: dict[str, dict], out_dir: Path) -> dict:
    """The entry of one run of each per seed: the comparison of their means, and each seed's own."""
    if len({r["mode"] for r in raws.values()}) != 1:
        raise ValueError(f"the seeds ran different loops: {sorted({r['mode'] for r in raws.values()})}")
    mode = next(iter(raws.values()))["mode"]
    runs = {name: [r[name]["curve"] for r in raws.values()] for name in ("ours", "trl")}
    cmp = compare(pooled([r["ours"] for r in raws.values()]), pooled([r["trl"] for r in raws.values()]))
    per_seed = {seed: compare(r["ours"], r["trl"]) for seed, r in raws.items()}
    curves = {name: mean_curve(c) for name, c in runs.items()}
    ranges = {name: accuracy_range(c) for name, c in runs.items()}
    what = f"{_what(steps, interval)}, mean of seeds {', '.join(raws)}"
    return {
        "steps": steps,
        "eval_interval": interval,
        "seeds": list(raws),
        "results": {"mode": mode, "per_seed": raws},
        "comparison": cmp,
        "per_seed_comparison": per_seed,
        "tables": [*tables(cmp, curves, what, mode, ranges), seed_table(per_seed)],
        "plots": _plot(runs, out_dir, mode),
        "notes": [
            "Step times pooled over the seeds; the curves are the seeds' means (accuracy and wall time at each "
            "eval step), and the wall time to a level is read off the mean curves.",
            *_notes(next(iter(raws.values()))),
        ],
    }


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
