"""The TRL peer's time to accuracy at a second task shape: train_async.py and TRL's GRPOTrainer over three seeds at
the shape set's 32x4x40 (answers up to 32 tokens, groups of 4), where the per-step lead is smallest of the shapes a
run of three seeds can afford on 2 cores.

    python -m benchmarks.trl_peer_accuracy [--seeds 1 2 3] [--out DIR]
    python -m benchmarks.run --only trl_peer_accuracy [--quick]

Each seed runs both sides as ``benchmarks/trl_peer.py``'s README row does (ours ``--synchronous``, on-policy as TRL
is, the cosine of a 60-step run, 30 steps, a held-out eval of 4 samples a prompt every 5, both on the same prompts
in the same order and at the same precision), at the shape's group and answer cap and on its prompts
(``benchmarks/trl_peer_shapes.py``: the quickstart's multiplication questions asking for the working). Each seed's
raw result is kept in ``benchmarks/results/trl_peer_accuracy_runs/SHAPE/seed-S.json`` with the commit, date and
machine it ran on, and read back when its flags match (three seeds take about two hours here). Reported as
``trl_peer`` reports its seeds: seconds per step, the mean curves, and the wall time each side takes to reach TRL's
final accuracy (goal: 3x).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import RECORD_HELP, finish_stamp, kept_machine, ran_stamp, write_entry
from benchmarks.trl_peer import FULL, FULL_LAUNCHER_ARGS, FULL_SEEDS, QUICK, prepare_assets, run_kept, seed_args
from benchmarks.trl_peer_report import headline as peer_headline
from benchmarks.trl_peer_report import mean_curve, summarize_seeds
from benchmarks.trl_peer_shapes import PROMPTS_PER_STEP, SHAPES, WORKING, Shape, write_shaped_data

SHAPE = SHAPES[1]  # 32x4x40
QUICK_SHAPE, QUICK_SEEDS = Shape(8, 2, 40), (1,)


def launcher_args(shape: Shape) -> list[str]:
    """Our launcher's flags at ``shape``: trl_peer's README row (on-policy, the cosine of a 60-step run, the
    quickstart's eval of 4 samples a prompt) at the shape's group and answer cap."""
    return [
        *FULL_LAUNCHER_ARGS,
        "--n-samples-per-prompt",
        str(shape.group),
        "--rollout-max-response-len",
        str(shape.answer),
        "--eval-max-response-len",
        str(shape.answer),
        *(["--max-tokens-per-gpu", str(shape.max_tokens)] if shape.max_tokens else []),
    ]


def task(shape: Shape) -> str:
    """What ran, for the titles (``{steps}`` and ``{interval}`` filled in by the report)."""
    asked = f", {WORKING!r} asked" if shape.answer >= 32 else ""
    return (
        f"SmolLM2-135M at shape {shape.name} (multiplication{asked}), {{steps}} steps of {PROMPTS_PER_STEP} prompts "
        f"x {shape.group}, answers up to {shape.answer} tokens, eval every {{interval}}"
    )


def _kept(path: Path, args: Sequence[str], steps: int) -> dict | None:
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    whole = all(len(raw[side]["step_seconds"]) == steps for side in ("ours", "trl"))
    return raw if raw.get("launcher_args") == list(args) and whole else None


def measure(
    shape: Shape,
    work: Path,
    steps: tuple[int, int] = FULL,
    seeds: Sequence[int] = FULL_SEEDS,
    run_missing: bool = True,
    plot_dir: Path | None = None,
) -> dict | None:
    """One run of each per seed at ``shape`` (``steps``: steps and eval interval), each seed kept in
    ``work``/SHAPE/seed-S.json and read back when its flags and step count match; summed up as
    ``benchmarks/trl_peer.py``'s seeds are, the plot in ``plot_dir`` (default: that folder). None when a seed is
    missing and ``run_missing`` is off."""
    folder = work / shape.name
    folder.mkdir(parents=True, exist_ok=True)
    raws = {}
    for seed in seeds:
        path, args = folder / f"seed-{seed}.json", [*launcher_args(shape), *seed_args(seed)]
        raw = _kept(path, args, steps[0])
        if raw is None:
            if not run_missing:
                return None
            _, data = prepare_assets()
            print(f"[trl_peer_accuracy] shape {shape.name}, seed {seed}", file=sys.stderr, flush=True)
            stamp = ran_stamp()
            raw = run_kept(*steps, args, write_shaped_data(data, shape, folder / "data"))
            raw["ran"] = finish_stamp(stamp)
            path.write_text(json.dumps(raw, indent=1) + "\n")
        raws[str(seed)] = raw
    plot = (f"SmolLM2, shape {shape.name}", f"trl_peer_accuracy_{shape.name}.png")
    entry = summarize_seeds(*steps, raws, plot_dir or folder, task(shape), plot)
    entry["machine"] = kept_machine([r["ran"] for r in raws.values()])
    return entry


def run(quick: bool, out_dir: Path) -> dict:
    """benchmarks.run's entry: SHAPE over trl_peer's three seeds, kept in ``out_dir``/trl_peer_accuracy_runs; quick,
    2 steps of a small shape with one seed, in ``out_dir``/trl_peer_accuracy_quick."""
    if quick:
        entry = measure(QUICK_SHAPE, out_dir / "trl_peer_accuracy_quick", QUICK, QUICK_SEEDS, plot_dir=out_dir)
    else:
        entry = measure(SHAPE, out_dir / "trl_peer_accuracy_runs", plot_dir=out_dir)
    assert entry is not None  # run_missing: every seed ran or was kept
    return entry


def accuracy_at(curve: Sequence[Sequence[float]], seconds: float) -> float | None:
    """The accuracy of a ``(step, accuracy, seconds)`` curve at ``seconds``, read linearly between its evals; None
    outside them."""
    for (_, a0, t0), (_, a1, t1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return a0 + (a1 - a0) * (seconds - t0) / (t1 - t0) if t1 > t0 else a1
    return None


def headline(entry: dict) -> list[list[str]]:
    """trl_peer's rows, and both sides' accuracy when our run ends (where it ends before TRL's, the time to TRL's
    final accuracy may lie beyond it)."""
    per_seed = entry["results"]["per_seed"].values()
    ours, trl = (mean_curve([r[side]["curve"] for r in per_seed]) for side in ("ours", "trl"))
    end = ours[-1][2]
    at = accuracy_at(trl, end)
    row = [
        f"TRL GRPOTrainer peer, {entry['task']}: held-out accuracy when our {ours[-1][0]} steps end ({end:.0f} s), "
        "ours vs TRL (TRL's mean curve read between its evals)",
        f"{ours[-1][1]:.2f} vs {'-' if at is None else format(at, '.2f')}",
    ]
    return [*peer_headline(entry), row]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(FULL_SEEDS))
    ap.add_argument("--out", type=Path, default=Path("outputs/trl_peer_accuracy"), help="kept seeds and results")
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    ap.add_argument("--kept-only", action="store_true", help="sum up the kept seeds; run none")
    args = ap.parse_args(argv)
    entry = measure(SHAPE, args.out, seeds=args.seeds, run_missing=not args.kept_only)
    if entry is None:
        ap.error(f"--kept-only: not every seed of {args.seeds} is kept in {args.out / SHAPE.name}")
    write_entry(entry, args.out, "trl_peer_accuracy" if args.record else None, argv)
    for what, result in headline(entry):
        print(f"{what}: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
