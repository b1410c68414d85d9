"""The async gain on real training: the quickstart's SmolLM2 task with the trainer and the engine on disjoint cores,
as a GPU cluster gives them disjoint GPUs, run ``--synchronous``, one step off and ``--fully-async``.

    python -m benchmarks.async_real [--quick] [--steps 20]
    python -m benchmarks.run --only async_real [--quick]

Every run is README command 1's launcher (``scripts/run-smollm2-cpu-async.sh``: SmolLM2-135M, single-digit
multiplication, 8 prompts x 8 samples) with the same seed and data:

- ``--train-cpu-affinity 0 --rollout-cpu-affinity 1``: trainer on core 0, engine on core 1. Synchronous leaves one
  side idle at a time, as on disaggregated GPUs; one step off and fully-async overlap them;
- synchronous with both cores shared (no affinity): what a one-machine user gets without the split.

Held-out evals (one sample a prompt) run every 5 steps in every run's wall clock: a synchronous run's between
steps, an overlapped run's in the background on the engine. Reported per run, over the steps after the first (the
first fills the pipeline): samples trained per second, the median step, each side's idle fraction (the trainer's
from its training seconds, the engine's as the run measures it), and held-out accuracy at the wall time of the
shortest run. The overlap bound is (T + G) / max(T, G), T and G the median training and generation seconds of the
pinned synchronous run's steps; the one-step-off gain is its median step against the pinned synchronous run's.

Long tail: one step off and fully-async again, pinned, 6 steps each, the answers capped at 32 tokens instead of 8:
some end in a few tokens (the prompts ask for the bare number), others ramble to the cap, real lengths with a long
tail; fully-async should stay at or above one step off there. (Answers that ask for the working, as
``benchmarks/trl_peer_shapes.py``'s long-answer prompts do, mostly run to the cap: no tail, and a step of minutes on
one core; capped at 64, SmolLM2's answers averaged 32 tokens and the first step took 107 s.)

Each run's metrics, evals and flags are kept (``benchmarks.run``: ``results/async_real_runs/``); a run kept with the
same flags and all its steps is read back instead of run again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import eval_curve, finish_stamp, kept_machine, median, ran_stamp, run_quickstart, table

PINNED = ("--train-cpu-affinity", "0", "--rollout-cpu-affinity", "1")
EVAL_KEY = "eval/mul/accuracy"
GOAL = 0.9  # one step off's gain as a fraction of the overlap bound


@dataclass(frozen=True)
class Mode:
    name: str
    flags: tuple[str, ...]


MODES = (
    Mode("synchronous, pinned", ("--synchronous", *PINNED)),
    Mode("one-step-off, pinned", PINNED),
    Mode("fully-async, pinned", ("--fully-async", *PINNED)),
    Mode("synchronous, shared cores", ("--synchronous",)),
)
LONG_TAIL = (
    Mode("one-step-off, pinned, long tail", PINNED),
    Mode("fully-async, pinned, long tail", ("--fully-async", *PINNED)),
)
LONG_TAIL_ANSWER = 32


# ---- one run's account (pure) ----


def run_stats(rows: Sequence[dict], evals: Sequence[dict], synchronous: bool) -> dict:
    """Throughput, idle fractions, step parts and the accuracy curve of one run, from its metrics.jsonl and
    eval.jsonl rows; the first step (the pipeline's fill) is left out of the rates."""
    if len(rows) < 2:
        raise ValueError(f"{len(rows)} step(s): the rates need two or more")
    steady = rows[1:]
    window = rows[-1]["train/finished_at"] - rows[0]["train/finished_at"]
    if window <= 0:
        raise ValueError("the steps after the first took no time")
    train_busy = sum(r["train/seconds"] for r in steady)
    step_s = [r["time/step_seconds"] for r in steady]
    engine_idle = [r.get("engine/idle_frac") for r in steady]
    return {
        "steps": len(steady),
        "samples_per_s": sum(r["rollout/num_samples"] for r in steady) / window,
        "step_median": median(step_s),
        "train_median": median([r["train/seconds"] for r in steady]),
        "generate_median": median([r["rollout/generate_seconds"] for r in steady]),
        "trainer_idle": max(0.0, 1.0 - train_busy / window),
        "engine_idle": (
            None if None in engine_idle else sum(f * s for f, s in zip(engine_idle, step_s, strict=True)) / sum(step_s)
        ),
        "response_len_mean": sum(r["rollout/response_len_mean"] for r in steady) / len(steady),
        "response_len_max": max(r.get("rollout/response_len_max", 0) for r in steady),
        "curve": eval_curve(list(rows), list(evals), EVAL_KEY) if evals else [],
        "synchronous": synchronous,
    }


def overlap_bound(train: float, generate: float) -> float:
    """How much faster a step can get when training and generation, which a synchronous step runs one after the
    other, overlap fully."""
    return (train + generate) / max(train, generate)


def accuracy_at(curve: Sequence[tuple[int, float, float]], seconds: float) -> float | None:
    """The last held-out accuracy measured on weights ready by ``seconds`` of wall time."""
    ready = [acc for _, acc, t in curve if t <= seconds + 1e-9]
    return ready[-1] if ready else None


# ---- the comparison (pure) ----


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summarize(stats: dict[str, dict], long_tail: dict[str, dict] | None = None) -> dict:
    sync, off = stats[MODES[0].name], stats[MODES[1].name]
    bound = overlap_bound(sync["train_median"], sync["generate_median"])
    gain = sync["step_median"] / off["step_median"]
    ends = [s["curve"][-1][2] for s in stats.values() if s["curve"]]
    equal_wall = min(ends) if len(ends) == len(stats) else None
    rows = [
        [
            name,
            f"{s['samples_per_s']:.2f}",
            f"{s['step_median']:.1f}",
            f"{s['train_median']:.1f} / {s['generate_median']:.1f}",
            f"{s['trainer_idle']:.0%}",
            _f(s["engine_idle"], ".0%"),
            _f(accuracy_at(s["curve"], equal_wall) if equal_wall is not None else None, ".3f"),
        ]
        for name, s in stats.items()
    ]
    tables = [
        table(
            "Real training, SmolLM2-135M quickstart: trainer on core 0 and engine on core 1 (pinned) against both "
            "sharing the two cores",
            [
                "run",
                "samples/s",
                "median step s",
                "median train / generate s",
                "trainer idle",
                "engine idle",
                f"accuracy at {_f(equal_wall, '.0f')} s",
            ],
            rows,
            "steps after the first; held-out evals every 5 steps inside every run's clock; fully-async generates in "
            "its producer, outside the step (generate 0); accuracy: the last eval whose weights were ready by the "
            "shortest run's last eval",
        ),
        table(
            "One step off against its overlap bound (pinned)",
            ["T (train)", "G (generate)", "bound (T + G) / max(T, G)", "one-step-off gain", "fraction of the bound"],
            [
                [
                    f"{sync['train_median']:.2f} s",
                    f"{sync['generate_median']:.2f} s",
                    f"{bound:.2f}x",
                    f"{gain:.2f}x",
                    f"{gain / bound:.0%}",
                ]
            ],
            f"T, G: medians of the pinned synchronous run's steps; gain: its median step over one step off's; goal "
            f"{GOAL:.0%} of the bound",
        ),
    ]
    out = {"stats": stats, "bound": bound, "one_step_off_gain": gain, "fraction_of_bound": gain / bound}
    out["fully_async_vs_one_step_off"] = stats[MODES[2].name]["samples_per_s"] / off["samples_per_s"]
    if long_tail:
        (off_name, off_lt), (_, fa_lt) = long_tail.items()
        out["long_tail"] = long_tail
        out["long_tail_ratio"] = fa_lt["samples_per_s"] / off_lt["samples_per_s"]
        tables.append(
            table(
                f"Long-tailed answers (capped at {LONG_TAIL_ANSWER} tokens instead of 8), pinned",
                ["run", "samples/s", "median step s", "mean answer tokens", "longest", "trainer idle", "engine idle"],
                [
                    [
                        name,
                        f"{s['samples_per_s']:.2f}",
                        f"{s['step_median']:.1f}",
                        f"{s['response_len_mean']:.1f}",
                        str(s["response_len_max"]),
                        f"{s['trainer_idle']:.0%}",
                        _f(s["engine_idle"], ".0%"),
                    ]
                    for name, s in long_tail.items()
                ],
                f"fully-async / {off_name}: {out['long_tail_ratio']:.2f}x samples/s",
            )
        )
    out["tables"] = tables
    shared = stats[MODES[3].name]
    out["notes"] = [
        f"One step off overlaps the pinned sides to {gain:.2f}x the synchronous step, {gain / bound:.0%} of the "
        f"{bound:.2f}x bound (goal {GOAL:.0%}); the trainer then idles {off['trainer_idle']:.0%} of the time, against "
        f"{sync['trainer_idle']:.0%} synchronous.",
        f"On one machine without the split, synchronous on both cores gives {shared['samples_per_s']:.2f} samples/s, "
        f"{shared['samples_per_s'] / off['samples_per_s']:.2f}x the pinned one-step-off run's: its training takes "
        f"{shared['train_median']:.1f} s on two cores against {off['train_median']:.1f} s on one. The overlap pays "
        "where each side has its own device, as on a GPU cluster.",
    ]
    if long_tail:
        (_, off_lt), (_, fa_lt) = long_tail.items()
        out["notes"].append(
            f"Long tail: fully-async at {out['long_tail_ratio']:.2f}x one step off's samples/s. Training binds both "
            f"(the trainer idles {off_lt['trainer_idle']:.0%} and {fa_lt['trainer_idle']:.0%} of the time, the "
            f"engine {_f(off_lt['engine_idle'], '.0%')} and {_f(fa_lt['engine_idle'], '.0%')}): generating ahead, "
            "fully-async's gain, has nothing to hide when the engine already waits on the trainer."
        )
    every = {**stats, **(long_tail or {})}
    ran = {name: s["ran"] for name, s in every.items() if s.get("ran")}
    if ran:
        out["notes"].append(
            "Each run as it ran (kept in async_real_runs/; an interrupted benchmark reads finished runs back): "
            + "; ".join(
                f"{name}: commit {r['commit']}, {r['date'][:16]}"
                + (f", 1-minute load {r['load'][0]}-{r['load'][-1]}" if r.get("load") else "")
                for name, r in ran.items()
            )
        )
    return out


def headline(entry: dict) -> list[list[str]]:
    rows = [
        [
            "real async gain, SmolLM2 quickstart, trainer and engine on disjoint cores: one step off against "
            "synchronous, and against the overlap bound (T + G) / max(T, G)",
            f"{entry['one_step_off_gain']:.2f}x of a {entry['bound']:.2f}x bound ({entry['fraction_of_bound']:.0%}; "
            f"goal {GOAL:.0%})",
        ],
        [
            "fully-async against one step off, same pinning, samples/s",
            f"{entry['fully_async_vs_one_step_off']:.2f}x",
        ],
    ]
    if "long_tail_ratio" in entry:
        rows.append(
            [
                f"fully-async against one step off, answers up to {LONG_TAIL_ANSWER} tokens (long tail), samples/s",
                f"{entry['long_tail_ratio']:.2f}x",
            ]
        )
    return rows


# ---- running (I/O) ----


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _measure(
    mode: Mode, steps: int, eval_interval: int, model: Path, data: Path, keep: Path, extra: Sequence[str]
) -> dict:
    """One run's stats; its metrics, evals and flags are kept in ``keep``, and a run kept there with the same flags
    and all its steps is read instead of run again (an interrupted benchmark goes on where it stopped)."""
    flags = ["--num-rollout", str(steps), "--eval-interval", str(eval_interval), "--save-interval", str(10 * steps)]
    flags += ["--n-samples-per-eval-prompt", "1", "--no-plot", *extra, *mode.flags]
    kept = keep / "flags.json"
    if not (kept.exists() and json.loads(kept.read_text()) == flags and len(_jsonl(keep / "metrics.jsonl")) == steps):
        print(f"[async_real] {mode.name}, {steps} steps", file=sys.stderr, flush=True)
        ran = ran_stamp()
        with tempfile.TemporaryDirectory(prefix="miles_async_async_real_") as tmp:
            out = Path(tmp) / "run"
            run_quickstart(flags, model, data, out, timeout=600 + 120 * steps)
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "eval.jsonl"):
                if (out / name).exists():
                    shutil.copy(out / name, keep / name)
        (keep / "ran.json").write_text(json.dumps(finish_stamp(ran)) + "\n")
        kept.write_text(json.dumps(flags) + "\n")
    stats = run_stats(_jsonl(keep / "metrics.jsonl"), _jsonl(keep / "eval.jsonl"), "--synchronous" in mode.flags)
    ran_path = keep / "ran.json"
    return {**stats, "ran": json.loads(ran_path.read_text()) if ran_path.exists() else None}


def _slug(mode: Mode) -> str:
    return mode.name.replace(", ", "-").replace(" ", "-")


def measure(steps: int, long_tail_steps: int, keep: Path) -> dict:
    from benchmarks.trl_peer import prepare_assets

    if len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("async_real pins the trainer and the engine to two cores; this process has fewer")
    model, data = prepare_assets()
    stats = {m.name: _measure(m, steps, 5, model, data, keep / _slug(m), ()) for m in MODES}
    long_tail = None
    if long_tail_steps:
        cap = ("--rollout-max-response-len", str(LONG_TAIL_ANSWER), "--eval-max-response-len", str(LONG_TAIL_ANSWER))
        long_tail = {
            m.name: _measure(m, long_tail_steps, 10 * long_tail_steps, model, data, keep / _slug(m), cap)
            for m in LONG_TAIL
        }
    entry = summarize(stats, long_tail)
    ran = [r["ran"] for r in [*stats.values(), *(long_tail or {}).values()]]
    if all(ran):
        # The runs may be older than this invocation (read back): the entry names the commits and date they ran at.
        entry["machine"] = kept_machine(ran)
    return entry


def run(quick: bool, out_dir: Path) -> dict:
    """benchmarks.run's entry: 20 steps a run and 6 for the long tail, each run's metrics kept in
    ``out_dir``/async_real_runs/; quick: 3 steps a run, no long tail, kept in a scratch folder."""
    if quick:
        with tempfile.TemporaryDirectory(prefix="miles_async_async_real_") as tmp:
            return measure(3, 0, Path(tmp))
    return measure(20, 6, out_dir / "async_real_runs")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import RECORD_HELP, write_entry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="steps a run (default 20; quick 3)")
    ap.add_argument("--long-tail-steps", type=int, default=None, help="steps of each long-tail run (0: none)")
    ap.add_argument("--out", type=Path, default=Path("outputs/async_real"))
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 20)
    lt = args.long_tail_steps if args.long_tail_steps is not None else (0 if args.quick else 6)
    args.out.mkdir(parents=True, exist_ok=True)
    entry = measure(steps, lt, args.out / "runs")
    write_entry(entry, args.out, "async_real" if args.record else None, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
