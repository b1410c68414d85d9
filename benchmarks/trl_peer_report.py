"""The TRL peer's results (pure but for the plot): comparisons of our run and TRL's, the mean of several seeds,
and the tables, headline and notes benchmarks/trl_peer.py reports them with."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import median, table, time_to_reach

Curve = list[tuple[int, float, float]]  # (step, accuracy, training wall seconds when the eval's weights were ready)


def ratio(slow: float | None, fast: float | None) -> float | None:
    """``slow / fast``, None when either is missing or ``fast`` is not positive."""
    if slow is None or fast is None or fast <= 0:
        return None
    return slow / fast


def welch_t(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Welch's t of ``mean(b) - mean(a)``: the difference of two samples' means over its standard error; None with
    fewer than two values a side or no spread in either."""
    if len(a) < 2 or len(b) < 2:
        return None
    se2 = statistics.variance(a) / len(a) + statistics.variance(b) / len(b)
    return (statistics.fmean(b) - statistics.fmean(a)) / se2**0.5 if se2 > 0 else None


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
    task = entry.get("task", f"SmolLM2 quickstart, {entry['steps']} steps")  # entries before the task was recorded
    what = f"TRL GRPOTrainer peer, {task}, ours {mode}"
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
        result = (
            f"{lv['ours_seconds']:.0f} s (step {lv['ours_step']}) vs {lv['trl_seconds']:.0f} s (step {lv['trl_step']}) "
            f"({lv['speedup']:.2f}x); {finals} (goal: 3x)"
        )
    rows.append([f"{what}: wall time to TRL's final held-out accuracy ({lv['level']:.2f}), ours vs TRL", result])
    ours_level = next(lv for lv in c["levels"] if lv["of"] == "ours")
    if ours_level["level"] < lv["level"] and ours_level["speedup"] is not None:
        # Ours ends below TRL's final: the level both reach is ours', and the steps each took to it show whether the
        # miss is the step's time or the learning per step.
        rows.append(
            [
                f"{what}: wall time to our final held-out accuracy ({ours_level['level']:.2f}), which both reach, "
                "ours vs TRL (first eval at or above it)",
                f"{ours_level['ours_seconds']:.0f} s (step {ours_level['ours_step']}) vs "
                f"{ours_level['trl_seconds']:.0f} s (step {ours_level['trl_step']}) ({ours_level['speedup']:.2f}x)",
            ]
        )
    per_seed = entry.get("per_seed_comparison", {}).values()
    finals = {side: [s[side]["final_accuracy"] for s in per_seed] for side in ("ours", "trl")}
    t = welch_t(finals["ours"], finals["trl"])
    if t is not None:
        gap = statistics.fmean(finals["trl"]) - statistics.fmean(finals["ours"])
        rows.append(
            [
                f"{what}: final held-out accuracy by seed, ours vs TRL, and Welch's t of the gap (TRL's mean - ours)",
                ", ".join(f"{o:.2f} vs {r:.2f}" for o, r in zip(finals["ours"], finals["trl"]))
                + f"; gap {gap:+.2f}, t {t:.1f} over {len(finals['ours'])} seeds a side",
            ]
        )
    return rows


def _plot(
    runs: dict[str, list[Curve]],
    out_dir: Path,
    mode: str,
    title: str = "SmolLM2 quickstart",
    name: str = "trl_peer.png",
) -> list[str]:
    """Held-out accuracy against wall time: each side's mean over its runs, and each run faintly when several."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side, label, color in (("ours", f"train_async.py ({mode})", "C0"), ("trl", "TRL GRPOTrainer", "C1")):
        if len(runs[side]) > 1:
            label += f", mean of {len(runs[side])} seeds"
            for c in runs[side]:
                ax.plot([s for _, _, s in c], [a for _, a, _ in c], color=color, alpha=0.25, linewidth=1)
        c = mean_curve(runs[side])
        ax.plot([s for _, _, s in c], [a for _, a, _ in c], marker="o", color=color, label=label)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{title}: train_async.py vs TRL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return [name]


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


QUICKSTART = "SmolLM2-135M quickstart (multiplication), {steps} steps of 8 prompts x 8, eval every {interval}"


def _what(steps: int, interval: int, task: str = QUICKSTART) -> str:
    return task.format(steps=steps, interval=interval)


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


def summarize_seeds(
    steps: int,
    interval: int,
    raws: dict[str, dict],
    out_dir: Path,
    task: str = QUICKSTART,
    plot: tuple[str, str] = ("SmolLM2 quickstart", "trl_peer.png"),
) -> dict:
    """The entry of one run of each per seed: the comparison of their means, and each seed's own. ``task``: what
    ran, for the titles (``{steps}`` and ``{interval}`` filled in); ``plot``: the plot's title and file name."""
    if len({r["mode"] for r in raws.values()}) != 1:
        raise ValueError(f"the seeds ran different loops: {sorted({r['mode'] for r in raws.values()})}")
    mode = next(iter(raws.values()))["mode"]
    runs = {name: [r[name]["curve"] for r in raws.values()] for name in ("ours", "trl")}
    cmp = compare(pooled([r["ours"] for r in raws.values()]), pooled([r["trl"] for r in raws.values()]))
    per_seed = {seed: compare(r["ours"], r["trl"]) for seed, r in raws.items()}
    curves = {name: mean_curve(c) for name, c in runs.items()}
    ranges = {name: accuracy_range(c) for name, c in runs.items()}
    what = f"{_what(steps, interval, task)}, mean of seeds {', '.join(raws)}"
    return {
        "task": _what(steps, interval, task),
        "steps": steps,
        "eval_interval": interval,
        "seeds": list(raws),
        "results": {"mode": mode, "per_seed": raws},
        "comparison": cmp,
        "per_seed_comparison": per_seed,
        "tables": [*tables(cmp, curves, what, mode, ranges), seed_table(per_seed)],
        "plots": _plot(runs, out_dir, mode, *plot),
        "notes": [
            "Step times pooled over the seeds; the curves are the seeds' means (accuracy and wall time at each "
            "eval step), and the wall time to a level is read off the mean curves.",
            *_notes(next(iter(raws.values()))),
        ],
    }
