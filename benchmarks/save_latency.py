"""Checkpoint latency: interval saves written in the background (--async-save) against blocking ones
(--no-async-save), same model, same settings, in one invocation.

Both are real train_async.py runs (Ray actors, HTTP engine, trainer) with --save-interval 1 on a widened tiny
model (the tiny tokenizer and task, hidden 512, 6 layers: ~20M parameters, so each save writes ~0.25 GB of weights
and Adam state and takes measurable time). Reported, over the steps between the first (pipeline fill) and the
last (the final save blocks in both modes): the median ``time/save_seconds`` (how long the loop stood still for
the save), ``time/step_seconds`` and ``train/seconds`` (the training call, which shares the CPU with a background
write).

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python -m benchmarks.save_latency [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import run_train_async, table, tiny_run_flags, tiny_setup

MODES = {"--async-save": ["--async-save"], "--no-async-save": ["--no-async-save"]}
HIDDEN, LAYERS = 512, 6


def widen(model: Path, hidden: int = HIDDEN, layers: int = LAYERS) -> Path:
    """``model`` (a tiny model folder) rewritten with random weights of ``hidden`` x ``layers``, same tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    heads = hidden // 32
    config.update(
        {
            "hidden_size": hidden,
            "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "head_dim": 32,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model)
    return model


def _run(flags: list[str], out: Path, model: Path, data: Path, num_rollout: int) -> dict:
    rows = run_train_async(
        [
            *tiny_run_flags(model, data, 4, 2, 4, reward=("--rm-type", "first_integer")),
            "--use-tis",
            "--num-rollout",
            str(num_rollout),
            "--save",
            str(out / "ckpt"),
            "--save-interval",
            "1",
            *flags,
        ],
        out,
    )
    steady = rows[1:-1]
    return {
        "save_seconds": [r["time/save_seconds"] for r in steady],
        "step_seconds": [r["time/step_seconds"] for r in steady],
        "train_seconds": [r["train/seconds"] for r in steady],
        "final_save_seconds": rows[-1]["time/save_seconds"],
        "checkpoint_bytes": sum(p.stat().st_size for p in (out / "ckpt" / "iter_0000000").rglob("*") if p.is_file()),
    }


def run(quick: bool, out_dir: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="miles_async_save_latency_"))  # models and run folders, not results
    num_rollout = 5 if quick else 8
    repeats = 1 if quick else 2  # the modes alternate, so a load change on a shared machine hits both
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    try:
        model, train, _ = tiny_setup(work)
        widen(model)
        for rep in range(repeats):
            for name in list(MODES)[:: 1 if rep % 2 == 0 else -1]:
                out = work / f"{name.strip('-')}-{rep}"
                runs[name].append(_run(MODES[name], out, model, train, num_rollout))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {}
    for name, rs in runs.items():
        pooled = {key: [x for r in rs for x in r[key]] for key in ("save_seconds", "step_seconds", "train_seconds")}
        results[name] = {
            **{f"{key}_median": statistics.median(xs) for key, xs in pooled.items()},
            **pooled,
            "final_save_seconds": [r["final_save_seconds"] for r in rs],
            "checkpoint_bytes": rs[0]["checkpoint_bytes"],
        }
    base = results["--no-async-save"]
    rows = [
        [
            name,
            f"{r['save_seconds_median']:.3f}",
            f"{r['save_seconds_median'] / base['save_seconds_median']:.2f}x",
            f"{r['step_seconds_median']:.2f}",
            f"{r['step_seconds_median'] / base['step_seconds_median']:.2f}x",
            f"{r['train_seconds_median']:.2f}",
        ]
        for name, r in results.items()
    ]
    size = base["checkpoint_bytes"] / 2**20
    steps = len(base["save_seconds"])
    return {
        "results": results,
        "tables": [
            table(
                f"Interval saves every step, tiny model widened to hidden {HIDDEN} x {LAYERS} layers "
                f"({size:.0f} MiB per checkpoint, parts fsynced), median of {steps} steps ({repeats} runs each)",
                ["mode", "time/save_seconds", "save ratio", "time/step_seconds", "step ratio", "train/seconds"],
                rows,
                note="time/save_seconds is how long the loop stood still for the save; the first step (pipeline "
                "fill) and the last (the final save blocks in both modes) are left out.",
            )
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    result = run(args.quick, Path(tempfile.gettempdir()))
    print(json.dumps({name: {k: v for k, v in r.items() if "median" in k} for name, r in result["results"].items()}))
    print(json.dumps(result["results"]))


if __name__ == "__main__":
    main()
