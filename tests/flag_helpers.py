"""The smallest command line train_async.py accepts, for tests of flag parsing and validation."""

from __future__ import annotations

import json
from pathlib import Path

# What validation reads of an HF folder: a config.json naming its model type. Nothing loads weights.
MINIMAL_HF_CONFIG = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}


def minimal_flags(tmp_path: Path, n_prompts: int = 16, data: Path | None = None, **hf_config) -> list[str]:
    """A prompt file of ``n_prompts`` lines (unless ``data`` is given) and an HF folder with only a config.json,
    both under ``tmp_path``; the flags that make them a valid run."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({**MINIMAL_HF_CONFIG, **hf_config}))
    if data is None:
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(n_prompts)))
    return [
        "--use-tis",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "4",
        "--rm-type",
        "integer",
        "--output-dir",
        str(tmp_path / "out"),
    ]


def tiny_train_flags(model: Path, task: Path, out: Path, *extra: str) -> list[str]:
    """A trainer on a tiny model and task: rollouts of 4 prompts x 4 samples, micro-batches of at most 24
    tokens; ``extra`` sets the optimizer and the batch split."""
    common = "--use-tis --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout 2 --rm-type integer"
    return ["--hf-checkpoint", str(model), "--prompt-data", str(task), "--output-dir", str(out),
            *common.split(), "--max-tokens-per-gpu", "24", *extra]  # fmt: skip
