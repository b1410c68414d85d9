"""Real train_async.py runs of a tiny Qwen2-VL on image prompts (real Ray, the embedded engine, the torch backend):
a run saved and stopped midway, then resumed, trains every image sample of each epoch exactly once."""

from __future__ import annotations

import json
from collections import Counter

from tests.e2e.runner import run_train


def test_a_resumed_vision_language_run_trains_every_image_sample_of_an_epoch_once(tiny_vlm, tmp_path):
    from PIL import Image

    colors = [(220, 30, 30), (20, 40, 230), (0, 200, 0), (240, 240, 0)]
    records = []
    for i, color in enumerate(colors):
        Image.new("RGB", (16, 8 + 8 * (i % 2)), color).save(tmp_path / f"{i}.png")
        records.append({"prompt": "which digit?", "images": [f"{i}.png"], "label": str(i)})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = tmp_path / "ckpt"

    def args(out):
        return [
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
            "4",  # two epochs of 4 pictures, 2 a rollout
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "3",
            "--rollout-dtype",
            "float32",
            "--save",
            str(ckpt),
            "--save-interval",
            "1",
            "--output-dir",
            str(out),
            "--no-plot",
        ]

    # Stopped after its first rollout: the resume falls inside the first epoch.
    first = run_train(args(tmp_path / "a") + ["--debug-exit-after-rollout", "1"], tmp_path / "a")
    assert first.returncode == 0, first.output[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    second = run_train(args(tmp_path / "b") + ["--load", str(ckpt)], tmp_path / "b")
    assert second.returncode == 0, second.output[-4000:]
    assert [m["step"] for m in second.metrics if "train/loss" in m] == list(range(saved + 2, 5))
    # The lineage of trained rollouts: the first run's up to its checkpoint, then the resumed run's.
    lineage = [r for r in first.rollouts if r["rollout_id"] <= saved] + second.rollouts
    assert [r["rollout_id"] for r in lineage] == [0, 1, 2, 3], lineage
    assert all(len(group) == 2 for r in lineage for group in r["rewards"]), lineage  # both samples of each picture
    every = sorted(f"train.jsonl:{i + 1}" for i in range(len(records)))
    for epoch in (0, 1):
        counts = Counter(lineage[2 * epoch]["uids"] + lineage[2 * epoch + 1]["uids"])  # a uid per picture's group
        assert sorted(counts) == every and set(counts.values()) == {1}, (epoch, counts)
