"""Evaluation on held-out prompt sets: flags, checks and the typed ``EvalConfig``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.declare import at_least, flag, group, when_flag, within
from miles_async.config.multimodal import parse_multimodal_keys
from miles_async.config.rollout import SamplingConfig


@dataclass(frozen=True)
class EvalConfig:
    datasets: tuple[tuple[str, str], ...]  # (name, path)
    n_samples_per_prompt: int
    sampling: SamplingConfig
    skip_before_train: bool
    max_in_flight: int
    input_key: str
    label_key: str
    metadata_key: str | None = None
    failures_allowed: int = 0  # evals that may fail before the run exits non-zero
    image_key: str | None = None  # --multimodal-keys' image column, as in the training data


def _pairs(name: str, values: list[str] | None) -> str | None:
    if values and len(values) > 1 and len(values) % 2:
        return f"{name} takes NAME PATH pairs (or a single PATH)"
    return None


# Evals run every --eval-interval rollouts; without it nothing evaluates.
EVALS = when_flag("--eval-interval")

GROUPS = (
    group(
        "eval",
        flag(
            "--eval-prompt-data",
            nargs="+",
            default=None,
            metavar="NAME PATH",
            check=_pairs,
            effect_needs=EVALS,
            help="pairs of name and file (a single PATH is named 'eval')",
        ),
        flag(
            "--eval-interval",
            help="evaluate on --eval-prompt-data every N rollouts, in the background",
            type=int,
            default=None,
            check=at_least(1),
            needs=when_flag("--eval-prompt-data"),
        ),
        flag(
            "--n-samples-per-eval-prompt",
            help="responses per held-out prompt",
            type=int,
            default=1,
            check=at_least(1),
            effect_needs=EVALS,
        ),
        flag(
            "--eval-temperature",
            help="sampling temperature of evals (0: greedy)",
            type=float,
            default=0.0,
            check=at_least(0),
            effect_needs=EVALS,
        ),
        flag(
            "--eval-top-p",
            help="nucleus sampling of evals (1.0: off)",
            type=float,
            default=1.0,
            check=within(0, 1, low_open=True),
            effect_needs=EVALS,
        ),
        flag(
            "--eval-max-response-len",
            help="the most tokens per eval response (default: --rollout-max-response-len)",
            type=int,
            default=None,
            check=at_least(1),
            effect_needs=EVALS,
        ),
        flag(
            "--skip-eval-before-train",
            help="skip the eval of the initial model",
            action="store_true",
            effect_needs=EVALS,
        ),
        flag(
            "--max-in-flight-evals",
            "--eval-max-in-flight",  # Miles' spelling
            help="evals running at once; a new one waits for a slot",
            type=int,
            default=1,
            check=at_least(1),
            effect_needs=EVALS,
        ),
        flag(
            "--eval-failures-allowed",
            type=int,
            default=0,
            check=at_least(0),
            effect_needs=EVALS,
            help="evals that may fail (raise or time out) without failing the run; training goes on either way, "
            "and the end of the run lists every failed eval and exits non-zero when more failed",
        ),
    ),
)


def build(ns: argparse.Namespace, eval_datasets: tuple[tuple[str, str], ...]) -> EvalConfig:
    return EvalConfig(
        datasets=eval_datasets,
        n_samples_per_prompt=ns.n_samples_per_eval_prompt,
        sampling=SamplingConfig(
            ns.eval_temperature,
            ns.eval_top_p,
            -1,
            ns.eval_max_response_len or ns.rollout_max_response_len,
            tuple(ns.rollout_stop_token_ids or ()),
        ),
        skip_before_train=ns.skip_eval_before_train,
        max_in_flight=ns.max_in_flight_evals,
        input_key=ns.input_key,
        label_key=ns.label_key,
        metadata_key=ns.metadata_key,
        failures_allowed=ns.eval_failures_allowed,
        image_key=parse_multimodal_keys(ns.multimodal_keys).get("image"),
    )
