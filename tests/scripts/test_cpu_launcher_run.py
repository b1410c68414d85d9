"""scripts/run-smollm2-cpu-async.sh really run: a tiny model and task in place of SmolLM2 and
the multiplication data, tiny settings appended as extra flags (they override the
launcher's), a local Ray started by the run itself. Every file the launcher promises exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.scripts.helpers import ROOT

TINY = [
    "--num-rollout",
    "2",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--rollout-max-response-len",
    "4",
    "--eval-max-response-len",
    "4",
    "--n-samples-per-eval-prompt",
    "1",
    "--eval-interval",
    "2",
    "--rm-type",
    "first_integer",
    "--rollout-dtype",
    "float32",
    "--save-interval",
    "1",
    "--train-num-threads",
    "1",
    "--rollout-num-threads",
    "1",
    "--no-plot",
]


def test_cpu_launcher_runs_a_tiny_async_grpo_run(tiny_model, tiny_task, tmp_path):
    train, held_out = tiny_task
    assert held_out.parent == train.parent and train.name == "train.jsonl" and held_out.name == "eval.jsonl"
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        MODEL=str(tiny_model),
        DATA=str(train.parent),
        OUT=str(out),
        PYTHON=sys.executable,
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run-smollm2-cpu-async.sh"), *TINY],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    elapsed = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "[miles-async] done." in output

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [1, 2], metrics
    assert all("time/step_seconds" in m for m in metrics)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines() if x.strip()]
    assert {e["step"] for e in evals} == {0, 2}, evals  # before training and at --eval-interval
    # The launcher's checkpoint, sentinel and HF-export flags took effect (under OUT).
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (out / "hf" / "config.json").exists() and (out / "hf" / "tokenizer.json").exists()
    assert not (out / "SAVE_NOW").exists()
    print(f"CPU launcher tiny run: {elapsed:.1f} s")
