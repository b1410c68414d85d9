"""Time to accuracy: the one-step-off loop against the synchronous one, same task, same seed, same run.

Full: the quickstart (SmolLM2-135M learns single-digit multiplication) through its own launcher,
scripts/run-smollm2-cpu-async.sh, with held-out evals every 2 steps. Quick: the tiny model's task
(a reward for answering with a digit). Reported: wall time from the first rollout until the first
eval at or above the threshold (taken when that eval started, i.e. when its weights were ready), and
both runs' final accuracies. The threshold is a fraction of the synchronous run's final accuracy, so
it is a level reached late in the run: a low fixed one is reached by both modes in the first steps,
and its ratio is then just the ratio of step times.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, eval_curve, run_train_async, step_seconds, table, time_to_reach, tiny_setup

MODES = {"synchronous": ["--synchronous"], "one-step-off": []}
THRESHOLD_OF_SYNC_FINAL = 0.9


def _result(out: Path, rows: list[dict], key: str, mode: str) -> dict:
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    # --synchronous evals run between its steps: out of its clock, as the one-step-off's background ones are.
    between = mode == "synchronous"
    curve = eval_curve(rows, evals, key, between)
    steps = step_seconds(rows, between)
    return {
        "final_accuracy": curve[-1][1],
        "initial_accuracy": curve[0][1],
        "step_seconds_mean": sum(steps) / len(steps),
        "wall_seconds": rows[-1]["train/finished_at"]
        - rows[0]["rollout/started_at"]
        - sum(r.get("time/eval_seconds", 0.0) for r in rows if between),
        "curve": curve,
    }


def set_time_to_threshold(results: dict[str, dict]) -> float:
    """Adds each mode's first eval (after step 0) at or above ``THRESHOLD_OF_SYNC_FINAL`` x the synchronous
    run's final accuracy; returns that threshold."""
    threshold = THRESHOLD_OF_SYNC_FINAL * results["synchronous"]["final_accuracy"]
    for r in results.values():
        hit = time_to_reach(r["curve"], threshold)
        r["step_at_threshold"], r["seconds_to_threshold"] = hit if hit else (None, None)
    return threshold


def _quick(work: Path) -> tuple[dict, str]:
    model, train, held_out = tiny_setup(work)
    key = "eval/tiny/accuracy"
    results = {}
    for mode, flags in MODES.items():
        out = work / mode
        rows = run_train_async(
            [
                "--hf-checkpoint",
                str(model),
                "--prompt-data",
                str(train),
                "--eval-prompt-data",
                "tiny",
                str(held_out),
                "--apply-chat-template",
                "--custom-rm-path",
                "tests.e2e.rewards:starts_with_digit",
                "--rollout-batch-size",
                "8",
                "--n-samples-per-prompt",
                "4",
                "--rollout-max-response-len",
                "2",
                "--rollout-dtype",
                "float32",
                "--lr",
                "1e-2",
                "--rollout-shuffle",
                "--use-tis",
                "--num-rollout",
                "12",
                "--eval-interval",
                "2",
                "--n-samples-per-eval-prompt",
                "4",
                "--eval-temperature",
                "1.0",
                *flags,
            ],
            out,
        )
        results[mode] = _result(out, rows, key, mode)
    return results, "tiny model, 'starts with a digit' reward, 12 steps of 8 prompts x 4"


def _full(work: Path) -> tuple[dict, str]:
    from benchmarks.common import smollm2_path
    from miles_async.assets.arith_dataset import make_multiplication_dataset

    model = smollm2_path()
    make_multiplication_dataset(work / "mul", seed=0)
    key = "eval/mul/accuracy"
    results = {}
    for mode, flags in MODES.items():
        out = work / mode
        env = dict(
            os.environ,
            MODEL=str(model),
            DATA=str(work / "mul"),
            OUT=str(out),
            PYTHON=sys.executable,
            PYTHONPATH=str(ROOT),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        proc = subprocess.run(
            [
                "bash",
                str(ROOT / "scripts" / "run-smollm2-cpu-async.sh"),
                "--num-rollout",
                "16",
                "--eval-interval",
                "2",
                "--no-plot",
                *flags,
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the quickstart launcher failed ({mode}):\n{proc.stderr[-4000:]}")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        results[mode] = _result(out, rows, key, mode)
    return results, "SmolLM2-135M quickstart (multiplication), 16 steps of 8 prompts x 8, eval every 2"


def run(quick: bool, out_dir: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="miles_async_tta_"))
    try:
        results, what = _quick(work) if quick else _full(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    threshold = set_time_to_threshold(results)
    sync = results["synchronous"]["seconds_to_threshold"]
    rows = []
    for mode, r in results.items():
        t = r["seconds_to_threshold"]
        rows.append(
            [
                mode,
                f"{r['initial_accuracy']:.3f}",
                f"{r['final_accuracy']:.3f}",
                "not reached" if t is None else f"{t:.0f} (step {r['step_at_threshold']})",
                "-" if t is None or sync is None else f"{sync / t:.2f}x",
                f"{r['step_seconds_mean']:.1f}",
                f"{r['wall_seconds']:.0f}",
            ]
        )
    return {
        "results": results,
        "threshold": threshold,
        "tables": [
            table(
                f"Time to held-out accuracy {threshold:.3f} ({THRESHOLD_OF_SYNC_FINAL:.0%} of the "
                f"synchronous run's final accuracy): {what}",
                [
                    "mode",
                    "accuracy before",
                    "accuracy at the end",
                    "seconds to threshold",
                    "speed-up",
                    "step s (mean)",
                    "run s",
                ],
                rows,
                "same seed and data order in both modes",
            )
        ],
        "notes": [
            "The one-step-off loop trains each step on data one weight version old (with TIS); the "
            "synchronous loop on fresh data. Per step it saves the generation time the overlap hides; "
            "whether that turns into earlier accuracy also depends on the learning per step."
        ],
    }


def headline(entry: dict) -> list[list[str]]:
    r = entry["results"]
    sync, osf = r["synchronous"]["seconds_to_threshold"], r["one-step-off"]["seconds_to_threshold"]
    title = entry["tables"][0]["title"].split(":")[0].replace("Time to held-out accuracy", "time to accuracy")
    finals = f"final accuracy {r['one-step-off']['final_accuracy']:.2f} vs {r['synchronous']['final_accuracy']:.2f}"
    if sync is None or osf is None:
        return [[f"{title}, one-step-off vs synchronous", f"threshold not reached in both runs; {finals}"]]
    return [[f"{title}, one-step-off vs synchronous", f"{osf:.0f} s vs {sync:.0f} s ({sync / osf:.2f}x); {finals}"]]
