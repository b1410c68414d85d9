"""Long-tailed generation: fully-async against the one-step-off default loop, same settings, same run.

Both runs are real train_async.py runs (Ray actors, HTTP engine, trainer) on a tiny model whose
response lengths are forced to a Pareto distribution (benchmarks.workloads). Reported: samples
trained per second over the training loop, and the fraction of time the engine sat idle.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import table

ROOT = Path(__file__).resolve().parents[1]


def _run(mode_flags: list[str], out: Path, model: Path, data: Path, num_rollout: int) -> dict:
    args = [sys.executable, str(ROOT / "train_async.py"), "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--apply-chat-template", "--custom-rm-path", "benchmarks.workloads:constant_reward",
            "--custom-generate-function-path", "benchmarks.workloads:long_tail_generate",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "256",
            "--rollout-dtype", "float32", "--lr", "1e-3", "--num-rollout", str(num_rollout), "--use-tis",
            "--output-dir", str(out), "--no-plot", *mode_flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"train_async.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Skip the first step: it includes the pipeline fill, identical in both modes.
    steady = rows[1:]
    start = rows[0]["train/finished_at"]
    end = rows[-1]["train/finished_at"]
    samples = sum(r["rollout/num_samples"] for r in steady)
    step_s = [r["time/step_seconds"] for r in steady]
    idle = sum(r["engine/idle_frac"] * s for r, s in zip(steady, step_s)) / sum(step_s)
    tokens = sum(r["rollout/num_samples"] * r["rollout/response_len_mean"] for r in steady)
    return {"samples_per_second": samples / (end - start), "response_tokens_per_second": tokens / (end - start),
            "engine_idle_frac": idle,
            "step_seconds_mean": statistics.fmean(step_s),
            "staleness_max": max(r.get("async/staleness_max", 1) for r in steady),
            "response_len_mean": statistics.fmean(r["rollout/response_len_mean"] for r in steady)}


def run(quick: bool, out_dir: Path) -> dict:
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    work = Path(tempfile.mkdtemp(prefix="miles_async_long_tail_"))  # models and run folders, not results
    model = make_tiny_model(work / "model", seed=0)
    train, _ = make_tiny_task_dataset(work / "data", n_train=256, n_eval=8, seed=0)
    num_rollout = 8 if quick else 24
    modes = {
        "one-step-off (default)": [],
        "fully-async, staleness 2": ["--fully-async", "--max-staleness-steps", "2"],
    }
    try:
        results = {name: _run(flags, work / name.split()[0].strip(",()"), model, train, num_rollout)
                   for name, flags in modes.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["one-step-off (default)"]
    rows = [[name, f"{r['samples_per_second']:.1f}", f"{r['samples_per_second'] / base['samples_per_second']:.2f}x",
             f"{r['response_tokens_per_second']:.0f}",
             f"{r['response_tokens_per_second'] / base['response_tokens_per_second']:.2f}x",
             f"{r['response_len_mean']:.1f}", f"{r['engine_idle_frac']:.2f}", r["staleness_max"]]
            for name, r in results.items()]
    return {
        "results": results,
        "tables": [table("Long-tailed generation (Pareto lengths, alpha 1.2, 8..256 tokens), tiny model",
                         ["mode", "samples/s", "ratio", "trained response tokens/s", "ratio",
                          "mean trained length", "engine idle", "max staleness"], rows,
                         f"{num_rollout} rollouts of 8 prompts x 4 samples each; first step excluded")],
        "notes": ["Both modes run the same prompts, lengths and seed in one invocation; only the ratio is meaningful "
                  "on a shared machine.",
                  "Fully-async drains groups in completion order, so it trains shorter responses first; compare "
                  "the token rate as well as the sample rate."],
    }
