"""A vision-language prompt as the server engines (SGLang, vLLM) take it.

Our prompts hold each image's placeholder expanded to its patches (the trainer's and the embedded engine's form);
SGLang and vLLM expand each placeholder themselves, with their own processor, so they get each run of the image
token as one. The placeholder is never sampled: the trainer's log-probs ban it (``vision.hf.unsampled_token_ids``),
so the engine's must too, by a logit bias no token reaches (JSON has no -inf; exp(-1e30 + logit) is 0 in every
float type).
"""

from __future__ import annotations

import json
import os
from typing import Any

BANNED_LOGIT_BIAS = -1e30


def collapse_image_runs(input_ids: list[int], image_token_id: int) -> list[int]:
    """``input_ids`` with each run of ``image_token_id`` as one token."""
    out: list[int] = []
    for t in input_ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def image_token_of(model_path: str) -> int:
    """The ``image_token_id`` of the model folder's config.json; ValueError saying why not."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            return int(json.load(fh)["image_token_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"no image_token_id in {path}: {e}") from e


def vlm_request(
    input_ids: list[int], sampling_params: dict[str, Any], image_token: int, has_images: bool
) -> tuple[list[int], dict[str, Any]]:
    """A VLM's request: the placeholder banned from sampling, and with images, each placeholder run as one token."""
    bias = dict(sampling_params.get("logit_bias") or {})
    bias[str(image_token)] = BANNED_LOGIT_BIAS
    ids = collapse_image_runs(list(input_ids), image_token) if has_images else list(input_ids)
    return ids, {**sampling_params, "logit_bias": bias}
