"""Checkpoints (save, resume, the final HF folder): flags, checks and the typed ``CheckpointConfig``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from miles_async.config.declare import at_least, flag, group, require, when_flag


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    save_hf: str | None
    save_trigger_sentinel: str | None
    no_save_optim: bool
    # Interval saves written in the background (sentinel, control-API and final saves always block).
    async_save: bool = True


SAVE = when_flag("--save")
ASYNC_SAVE = flag(
    "--async-save",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="write --save-interval checkpoints in the background: the state is copied at the step boundary "
    "and the next step trains while it is written, so a save costs the copy, not the write (the pointer "
    "moves only once every part is on disk; at most one save in flight). On by default because an "
    "interval save otherwise stalls training for the whole write. --no-async-save: every save blocks. "
    "Sentinel and final saves always block",
)

GROUPS = (
    group(
        "model and checkpoints",
        flag("--load", default=None, help="checkpoint folder to resume from (its latest complete iteration)"),
        flag("--save", default=None, help="checkpoint folder"),
        flag(
            "--save-interval",
            help="save a checkpoint to --save every N rollouts (and always at the end)",
            type=int,
            default=None,
            check=at_least(1),
            needs=SAVE,
        ),
        flag("--save-hf", default=None, help="write the final policy as an HF folder here"),
        flag(
            "--save-trigger-sentinel",
            default=None,
            needs=SAVE,
            help="when this file exists after a step, save then delete it (preemption)",
        ),
        flag(
            "--no-save-optim",
            help="leave the optimizer state out of checkpoints (smaller; a resume starts the optimizer afresh)",
            action="store_true",
            effect_needs=SAVE,
        ),
        ASYNC_SAVE,
    ),
)


def start_rollout_id(ns: argparse.Namespace, num_rollout: int) -> int:
    """The rollout a run resumed from --load starts at (0 without it)."""
    from miles_async.utils.checkpoint import latest_checkpointed_iteration

    if ns.load is None:
        return 0
    require(Path(ns.load).is_dir(), f"--load: not a folder: {ns.load}")
    last = latest_checkpointed_iteration(ns.load)
    require(last is not None, f"--load: no complete checkpoint in {ns.load}")
    require(
        last + 1 < num_rollout, f"--load: the checkpoint already reached rollout {last} of --num-rollout {num_rollout}"
    )
    return last + 1


def build(ns: argparse.Namespace) -> CheckpointConfig:
    from miles_async.config.capabilities import supported

    return CheckpointConfig(
        ns.save,
        ns.load,
        ns.save_interval,
        ns.save_hf,
        ns.save_trigger_sentinel,
        ns.no_save_optim,
        async_save=ns.async_save and supported(ns, ASYNC_SAVE.name, ASYNC_SAVE),
    )
