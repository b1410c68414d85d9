"""--multimodal-keys: which columns of a record hold a sample's images, and what a run with images cannot do yet."""

from __future__ import annotations

import argparse
import json

from miles_async.config.declare import require

MULTIMODAL_MODALITIES = ("image",)


def parse_multimodal_keys(raw: str | None) -> dict[str, str]:
    """--multimodal-keys as {modality: column}; ``ValueError`` saying what is wrong."""
    if raw is None:
        return {}
    try:
        keys = json.loads(raw)
    except ValueError as e:
        raise ValueError(f'not JSON ({e}); expected e.g. \'{{"image": "images"}}\'') from e
    if not isinstance(keys, dict) or not keys or not all(isinstance(v, str) and v for v in keys.values()):
        raise ValueError('expected a JSON object of modality to column name, e.g. \'{"image": "images"}\'')
    unknown = sorted(set(keys) - set(MULTIMODAL_MODALITIES))
    if unknown:
        raise ValueError(f"unsupported modality {unknown}; supported: {list(MULTIMODAL_MODALITIES)}")
    return keys


def multimodal_problem(name: str, raw: str | None) -> str | None:
    """The flag check: what is wrong with ``raw``, named after the flag, or None."""
    try:
        parse_multimodal_keys(raw)
    except ValueError as e:
        return f"{name}: {e}"
    return None


def validate_multimodal(ns: argparse.Namespace) -> None:
    """--multimodal-keys: a model with a vision tower, and none of the paths that do not carry images yet."""
    from miles_async.vision.hf import is_vision_model

    if ns.multimodal_keys is None:
        return
    require(
        ns.hf_checkpoint is None or is_vision_model(ns.hf_checkpoint),
        f"--multimodal-keys: --hf-checkpoint {ns.hf_checkpoint} has no vision tower (no vision_config in its "
        "config.json); image prompts need a vision-language model",
    )
    require(
        ns.advantage_estimator != "ppo",
        "--multimodal-keys with --advantage-estimator ppo: the critic of a vision-language policy is not built yet",
    )
