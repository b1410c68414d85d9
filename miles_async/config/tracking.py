"""Where metrics go (JSONL always; wandb, tensorboard, the plot): flags and the typed ``TrackingConfig``."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from miles_async.config.declare import flag, group, importable, when_flag


@dataclass(frozen=True)
class TrackingConfig:
    output_dir: str
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    wandb_run_name: str | None
    use_tensorboard: bool
    tensorboard_dir: str | None
    plot: bool


USE_WANDB = when_flag("--use-wandb")

GROUPS = (
    group(
        "logging and debugging",
        flag("--output-dir", default=None, help="metrics JSONL, plot and logs (default: outputs/<time>)"),
        flag(
            "--use-wandb",
            help="log metrics to Weights & Biases (log in with `wandb login` or WANDB_API_KEY)",
            action="store_true",
            check=importable("wandb", "the wandb package: pip install 'miles_async[wandb]'"),
        ),
        flag("--wandb-project", help="the wandb project", default="miles-async", effect_needs=USE_WANDB),
        flag("--wandb-group", help="the wandb group", default=None, effect_needs=USE_WANDB),
        flag("--wandb-run-name", help="the wandb run's name", default=None, effect_needs=USE_WANDB),
        flag("--use-tensorboard", help="log metrics to TensorBoard", action="store_true"),
        flag(
            "--tensorboard-dir",
            help="the TensorBoard log folder (default: under --output-dir)",
            default=None,
            effect_needs=when_flag("--use-tensorboard"),
        ),
        flag("--no-plot", help="skip the reward/accuracy plot written at the end", action="store_true"),
    ),
)


def build(ns: argparse.Namespace) -> TrackingConfig:
    output_dir = ns.output_dir or os.path.join("outputs", time.strftime("%Y%m%d-%H%M%S"))
    return TrackingConfig(
        output_dir,
        ns.use_wandb,
        ns.wandb_project,
        ns.wandb_group,
        ns.wandb_run_name,
        ns.use_tensorboard,
        ns.tensorboard_dir,
        not ns.no_plot,
    )
