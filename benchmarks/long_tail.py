"""Long-tailed generation: fully-async against the one-step-off default loop, same settings, same run.

Both runs are real train_async.py runs (Ray actors, HTTP engine, trainer) on a tiny model whose
response lengths are forced to a Pareto distribution (benchmarks.workloads). Reported: samples
trained per second over the training loop, and the fraction of time the engine sat idle.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import run_train_async, table, tiny_run_flags, tiny_setup


def staleness_max(rows: list[dict]) -> int:
    """The most steps a trained token's weights lagged the weights it was trained on, from the versions
    the engines recorded: the row of step s trains weights version s - 1 on tokens whose oldest version is
    ``rollout/weight_version_min`` (here every response token is trained: no partial rollouts, no masks)."""
    return max(r["step"] - 1 - r["rollout/weight_version_min"] for r in rows)


def _run(mode_flags: list[str], out: Path, model: Path, data: Path, num_rollout: int) -> dict:
    rows = run_train_async(
        [
            *tiny_run_flags(model, data, 8, 4, 256, generate="long_tail_generate"),
            "--lr",
            "1e-3",
            "--num-rollout",
            str(num_rollout),
            "--use-tis",
            *mode_flags,
        ],
        out,
    )
    # Skip the first step: it includes the pipeline fill, identical in both modes.
    steady = rows[1:]
    start = rows[0]["train/finished_at"]
    end = rows[-1]["train/finished_at"]
    samples = sum(r["rollout/num_samples"] for r in steady)
    step_s = [r["time/step_seconds"] for r in steady]
    idle = sum(r["engine/idle_frac"] * s for r, s in zip(steady, step_s)) / sum(step_s)
    tokens = sum(r["rollout/num_samples"] * r["rollout/response_len_mean"] for r in steady)
    return {
        "samples_per_second": samples / (end - start),
        "response_tokens_per_second": tokens / (end - start),
        "engine_idle_frac": idle,
        "step_seconds_mean": statistics.fmean(step_s),
        "staleness_max": staleness_max(steady),
        "response_len_mean": statistics.fmean(r["rollout/response_len_mean"] for r in steady),
    }


def run(quick: bool, out_dir: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="miles_async_long_tail_"))  # models and run folders, not results
    model, train, _ = tiny_setup(work)
    num_rollout = 8 if quick else 24
    modes = {
        "one-step-off (default)": [],
        "fully-async, staleness 2": ["--fully-async", "--max-staleness-steps", "2"],
    }
    try:
        results = {
            name: _run(flags, work / name.split()[0].strip(",()"), model, train, num_rollout)
            for name, flags in modes.items()
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["one-step-off (default)"]
    rows = [
        [
            name,
            f"{r['samples_per_second']:.1f}",
            f"{r['samples_per_second'] / base['samples_per_second']:.2f}x",
            f"{r['response_tokens_per_second']:.0f}",
            f"{r['response_tokens_per_second'] / base['response_tokens_per_second']:.2f}x",
            f"{r['response_len_mean']:.1f}",
            f"{r['engine_idle_frac']:.2f}",
            r["staleness_max"],
        ]
        for name, r in results.items()
    ]
    return {
        "results": results,
        "tables": [
            table(
                "Long-tailed generation (Pareto lengths, alpha 1.2, 8..256 tokens), tiny model",
                [
                    "mode",
                    "samples/s",
                    "ratio",
                    "trained response tokens/s",
                    "ratio",
                    "mean trained length",
                    "engine idle",
                    "max staleness",
                ],
                rows,
                f"{num_rollout} rollouts of 8 prompts x 4 samples each; first step excluded",
            )
        ],
        "notes": [
            "Both modes run the same prompts, lengths and seed in one invocation; only the ratio is meaningful "
            "on a shared machine.",
            "Fully-async drains groups in completion order, so it trains shorter responses first; compare "
            "the token rate as well as the sample rate.",
        ],
    }


def headline(entry: dict) -> list[list[str]]:
    r = entry["results"]
    base, fa = r["one-step-off (default)"], r["fully-async, staleness 2"]
    return [
        [
            "fully-async vs one-step-off, long-tailed response lengths",
            f"{fa['samples_per_second'] / base['samples_per_second']:.2f}x samples/s, "
            f"{fa['response_tokens_per_second'] / base['response_tokens_per_second']:.2f}x trained tokens/s, "
            f"engine idle {fa['engine_idle_frac']:.0%} vs {base['engine_idle_frac']:.0%}",
        ]
    ]
