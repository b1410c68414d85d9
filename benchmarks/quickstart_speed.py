"""The quickstart's step time against an older revision's, side by side in one run.

Both trees run their own ``scripts/run-smollm2-cpu-async.sh`` (README command 1's launcher: SmolLM2-135M,
single-digit multiplication, 8 prompts x 8 samples, one step off) for the same number of steps on the same
model, data and seed, one after the other. Reported: the median of ``time/step_seconds`` and of its parts
(training, weight update) from each run's metrics, without the first step (start-up: the first rollout has
nothing to overlap with).

On a CPU without bf16 arithmetic, this tree trains and serves in float32 whatever the launcher asks (with a
warning); older trees took ``--bf16`` and ``--rollout-dtype bfloat16`` at their word, and torch emulates bf16
matmuls ~80x slower here. The older launcher is therefore run in float32 (its ``--bf16`` line dropped and its
rollout dtype set to float32), so the comparison is of the code, not of the emulation.

``python -m benchmarks.quickstart_speed --baseline e84358e --steps 10``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, export_tree, fmt, median, run_quickstart, table

# The tree the quickstart's speed-up was first measured against, in full: a shallow clone fetches it by this hash.
DEFAULT_BASELINE = "e84358eb327b99e6c64f546247594d01718cde95"
PARTS = {"step": "time/step_seconds", "train": "train/seconds", "weight update": "weights/update_seconds"}


def float32_launcher(text: str) -> str:
    """An older launcher's text with its bf16 requests turned into float32 (see the module docstring)."""
    lines = [line for line in text.splitlines() if line.strip() != "--bf16"]
    out = "\n".join(lines).replace("--rollout-dtype bfloat16", "--rollout-dtype float32")
    if "--rollout-dtype float32" not in out:
        out = out.replace("  --rollout-backend embedded", "  --rollout-backend embedded\n  --rollout-dtype float32")
    return out + "\n"


def summarize(rows: list[dict]) -> dict:
    """Median of each part over the steps after the first, and the steps counted."""
    timed = rows[1:]
    return {
        "steps": len(timed),
        **{part: median([r[key] for r in timed if key in r]) if any(key in r for r in timed) else None
           for part, key in PARTS.items()},
    }  # fmt: skip


def _launch(tree: Path, model: Path, data: Path, out: Path, steps: int, timeout: float) -> list[dict]:
    # Held-out evals only before the first and after the last step: they share the engine with the next rollout
    # in both trees, and are not what is timed.
    flags = ["--num-rollout", str(steps), "--eval-interval", str(10 * steps), "--save-interval", str(10 * steps)]
    return run_quickstart(flags, model, data, out, timeout, tree)


def run(quick: bool, out_dir: Path, baseline: str = DEFAULT_BASELINE, steps: int | None = None) -> dict:
    from benchmarks.common import smollm2_path
    from miles_async.assets.arith_dataset import make_multiplication_dataset

    steps = steps or (3 if quick else 10)
    load_before = round(os.getloadavg()[0], 1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        make_multiplication_dataset(data)
        old = export_tree(baseline, work / f"tree-{baseline}")
        launcher = old / "scripts" / "run-smollm2-cpu-async.sh"
        launcher.write_text(float32_launcher(launcher.read_text()))
        model = smollm2_path()
        timeout = 120 + 120 * steps
        runs = {
            "this tree": _launch(ROOT, model, data, work / "new", steps, timeout),
            f"@{baseline} (float32)": _launch(old, model, data, work / "old", steps, timeout),
        }
    results = {name: summarize(rows) for name, rows in runs.items()}
    new, old_r = results["this tree"], results[f"@{baseline} (float32)"]
    speedup = old_r["step"] / new["step"]
    rows = [[name, r["steps"], fmt(r["step"]), fmt(r["train"]), fmt(r["weight update"])] for name, r in results.items()]
    return {
        "baseline": baseline,
        "results": results,
        "speedup": speedup,
        "load_average": [load_before, round(os.getloadavg()[0], 1)],
        "tables": [
            table(
                f"Quickstart (scripts/run-smollm2-cpu-async.sh, {steps} steps, no periodic evals): "
                "median seconds per step",
                ["tree", "steps timed", "step", "training", "weight update"],
                rows,
                note="the first step (start-up) is not timed; the older launcher runs in float32",
            )
        ],
        "notes": [f"median step @{baseline} / this tree = {speedup:.2f}x"],
    }


def headline(entry: dict) -> list[tuple[str, str]]:
    new = entry["results"]["this tree"]["step"]
    old = entry["results"][f"@{entry['baseline']} (float32)"]["step"]
    return [
        (
            f"quickstart median step: the measured commit vs the older {entry['baseline']}, which ran it in float32",
            f"{new:.1f} s vs {old:.1f} s ({entry['speedup']:.2f}x)",
        )
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline", default=DEFAULT_BASELINE)
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args()
    result = run(a.quick, Path(tempfile.mkdtemp()), a.baseline, a.steps)
    from benchmarks.common import render_table

    for t in result["tables"]:
        print(render_table(t))
    print(*result["notes"], sep="\n")
    print(json.dumps(result["results"]))
