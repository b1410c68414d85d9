"""Checkpoints (save, resume, the final HF folder): flags, checks and the typed ``CheckpointConfig``."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from miles_async.config.declare import ConfigError, at_least, flag, group, require, when_flag
from miles_async.utils.megatron_layout import LayoutError, LoadState, load_state, looks_like_megatron

logger = logging.getLogger(__name__)


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
        flag(
            "--load",
            default=None,
            help="checkpoint folder to resume from (its latest complete iteration). An empty or missing folder "
            "starts a fresh run, as in Megatron-LM and Miles (so --load and --save may name the same folder on "
            "the first start and every requeue); the policy then starts from --ref-load when given, else from "
            "--hf-checkpoint. A Megatron-LM release checkpoint (tracker 'release') starts a fresh run from its "
            "weights (--train-backend megatron)",
        ),
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


def load_state_of(ns: argparse.Namespace) -> LoadState:
    """What --load starts from (fresh without --load); a partial save is refused, naming what is missing."""
    if ns.load is None:
        return LoadState()
    try:
        return load_state(ns.load)
    except LayoutError as e:
        raise ConfigError(f"--load: {e}") from None


def validate(ns: argparse.Namespace) -> None:
    """The torch backend builds HF models from HF weights: a Megatron (torch_dist) checkpoint is the Megatron
    backend's to read."""
    if ns.train_backend == "megatron":
        return
    if ns.ref_load is not None and looks_like_megatron(Path(ns.ref_load)):
        require(
            False,
            f"--ref-load: {ns.ref_load} is a Megatron (torch_dist) checkpoint, which --train-backend "
            f"{ns.train_backend} does not read (it builds HF models from HF weights): run --train-backend megatron, "
            f"which loads it into any parallel layout, or give as --ref-load the HF folder it was converted from "
            f"(--hf-checkpoint's, when the reference is the initial policy)",
        )
    if ns.load is not None and load_state_of(ns).weights is not None:
        require(
            False,
            f"--load: {ns.load} is a Megatron-LM release checkpoint (weights only), which --train-backend "
            f"{ns.train_backend} does not read (it builds HF models from HF weights): run --train-backend megatron, "
            f"or start from the HF folder it was converted from, as --hf-checkpoint with an empty --load",
        )


def start_from(ns: argparse.Namespace, state: LoadState) -> str | None:
    """Where a fresh run's policy weights come from when not --hf-checkpoint's (Miles' rule: a --load that holds
    no checkpoint starts from --ref-load), logged; None for --hf-checkpoint's or a resume."""
    if ns.load is None or state.resume is not None:
        return None
    if state.weights is not None:
        logger.info("--load %s holds a release checkpoint: a fresh run from its weights (%s)", ns.load, state.weights)
        return str(ns.load)
    logger.info(
        "--load %s holds no checkpoint: a fresh run from rollout 0, the policy from %s",
        ns.load,
        f"--ref-load {ns.ref_load}" if ns.ref_load is not None else f"--hf-checkpoint {ns.hf_checkpoint}",
    )
    return ns.ref_load


def start_rollout_id(state: LoadState, num_rollout: int) -> int:
    """The rollout a run resumed from --load starts at (0 for a fresh run)."""
    if state.resume is None:
        return 0
    last = state.resume
    require(
        last + 1 < num_rollout, f"--load: the checkpoint already reached rollout {last} of --num-rollout {num_rollout}"
    )
    return last + 1


def build(ns: argparse.Namespace, state: LoadState | None = None) -> CheckpointConfig:
    """``state``: what --load holds, when already read (``load_state_of``)."""
    from miles_async.config.capabilities import supported

    state = load_state_of(ns) if state is None else state
    return CheckpointConfig(
        ns.save,
        ns.load if state.resume is not None else None,  # a fresh run restores nothing
        ns.save_interval,
        ns.save_hf,
        ns.save_trigger_sentinel,
        ns.no_save_optim,
        async_save=ns.async_save and supported(ns, ASYNC_SAVE.name, ASYNC_SAVE),
    )
