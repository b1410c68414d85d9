"""The example's measurement: for each seed, the RL run (``run.sh``) and its control (the warm-up continued for the
RL run's wall time, ``warmup.py --minutes``), both from the cached warm-up; then both final models scored alike on
the held-out images. Writes ``results.json`` and ``vision_count.png`` to ``--out``.

    python -m examples.vision_count.study --out DIR [--seeds 1 2 3] [extra run.sh flags after --]

Run on a quiet machine: the control's budget is the RL run's wall time, and both share nothing while they run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from examples.vision_count.data import make_dataset
from examples.vision_count.prepare import prepare
from examples.vision_count.warmup import Counter

HERE = Path(__file__).resolve().parent


def _eval_curve(out: Path) -> list[dict]:
    """The RL run's held-out accuracy (its own evaluation: one answer sampled at temperature 1 per image per
    sample) against seconds since its first step."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = metrics[0]["train/started_at"]
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines() if line.strip()]
    return [
        {"step": r["step"], "seconds": max(0.0, r["eval/started_at"] - start), "accuracy": r["eval/count/accuracy"]}
        for r in rows
    ]


def run_seed(seed: int, model: Path, data: Path, out: Path, extra: list[str]) -> dict:
    rl_out = out / f"rl-seed{seed}"
    env = dict(os.environ, MODEL=str(model), DATA=str(data), OUT=str(rl_out), PYTHON=sys.executable)
    t0 = time.time()
    with open(out / f"rl-seed{seed}.log", "w") as log:
        subprocess.run(
            ["bash", str(HERE / "run.sh"), "--seed", str(seed), "--rollout-seed", str(seed), *extra],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    metrics = [json.loads(line) for line in (rl_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # From the first step's start to the last step's end: what the control gets to train.
    rl_seconds = metrics[-1]["train/finished_at"] - metrics[0]["train/started_at"]
    control_curve = out / f"control-seed{seed}.jsonl"
    control_curve.unlink(missing_ok=True)
    control = Counter(model, data)
    control.train(seed, None, rl_seconds, control_curve, every_s=60.0)
    rl_final = Counter(rl_out / "hf", data).accuracy()
    return {
        "seed": seed,
        "rl_seconds": round(rl_seconds, 1),
        "launcher_seconds": round(time.time() - t0, 1),
        "rl_final": rl_final,
        "control_final": control.accuracy(),
        "rl_curve": _eval_curve(rl_out),
        "control_curve": [json.loads(line) for line in control_curve.read_text().splitlines()],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(results["seeds"]):
        rl = r["rl_curve"]
        ctl = r["control_curve"]
        ax.plot([p["seconds"] / 60 for p in rl], [p["accuracy"] for p in rl], "-o", color="C0", alpha=0.7,
                label="GRPO (sampled answers)" if i == 0 else None)  # fmt: skip
        ax.plot([p["train_s"] / 60 for p in ctl], [p["p_correct"] for p in ctl], "-s", color="C1", alpha=0.7,
                label="control: warm-up continued (P(right answer))" if i == 0 else None)  # fmt: skip
    ax.axhline(results["start"]["p_correct"], color="gray", ls=":", label="after the warm-up")
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out accuracy (temperature 1)")
    ax.set_title("Counting shapes: RL against more supervised warm-up, 3 seeds")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--cache-dir", type=Path, default=None)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache_dir
    data = make_dataset((cache or Path(os.environ.get("MILES_ASYNC_CACHE", Path.home() / ".cache/miles-async")))
                        / "data" / "vision_count")  # fmt: skip
    model = prepare(data, cache)
    results: dict = {"model": str(model), "start": Counter(model, data).accuracy(), "seeds": []}
    for seed in args.seeds:
        results["seeds"].append(run_seed(seed, model, data, args.out, extra))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    for arm in ("rl_final", "control_final"):
        for key in ("p_correct", "greedy"):
            values = [r[arm][key] for r in results["seeds"]]
            results[f"{arm}_{key}_mean"] = statistics.mean(values)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "vision_count.png")
    print(json.dumps({k: v for k, v in results.items() if k.endswith("_mean") or k == "start"}, indent=1))


if __name__ == "__main__":
    main()
