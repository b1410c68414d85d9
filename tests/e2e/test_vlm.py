"""One real train_async.py run of a tiny Qwen2-VL on image prompts: real Ray, the embedded engine, the torch
backend."""

from __future__ import annotations

import json

from tests.e2e.runner import run_train


def test_a_vision_language_run_trains_on_image_prompts(tiny_vlm, tmp_path):
    from PIL import Image

    colors = [(220, 30, 30), (20, 40, 230), (0, 200, 0), (240, 240, 0)]
    records = []
    for i, color in enumerate(colors):
        Image.new("RGB", (16, 8 + 8 * (i % 2)), color).save(tmp_path / f"{i}.png")
        records.append({"prompt": "which digit?", "images": [f"{i}.png"], "label": str(i)})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    args = [
        "--hf-checkpoint",
        str(tiny_vlm),
        "--prompt-data",
        str(data),
        "--multimodal-keys",
        '{"image": "images"}',
        "--apply-chat-template",
        "--use-tis",
        "--rm-type",
        "first_integer",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "3",
        "--rollout-dtype",
        "float32",
        "--output-dir",
        str(out),
        "--no-plot",
    ]
    run = run_train(args, out)
    assert run.returncode == 0, run.output[-4000:]
    trained = [r for r in run.metrics if "train/loss" in r]
    assert len(trained) == 2, run.output[-4000:]
    # Every rollout drew image prompts of the dataset: the run trained on them, not on text alone.
    uids = {u for r in run.rollouts for u in r.get("uids", [])}
    assert uids <= {f"train.jsonl:{i + 1}" for i in range(len(records))} and uids, run.rollouts
