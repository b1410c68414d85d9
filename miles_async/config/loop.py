"""The training loop and its asynchrony (one-step-off, --fully-async, --synchronous): flags, checks and the
typed ``LoopConfig`` and ``FullyAsyncConfig``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.algorithm import CRITIC
from miles_async.config.declare import at_least, flag, group, positive, require, when_flag


@dataclass(frozen=True)
class FullyAsyncConfig:
    max_staleness_steps: int
    max_concurrent_groups: int
    watchdog_seconds: float


@dataclass(frozen=True)
class LoopConfig:
    num_rollout: int
    num_rollout_per_epoch: int
    start_rollout_id: int
    update_weights_interval: int
    eval_interval: int | None
    debug_exit_after_rollout: int | None
    fully_async: bool = False
    pause_generation_mode: str = "in_place"
    num_critic_only_steps: int = 0
    synchronous: bool = False  # generate each rollout only after the previous step's weights are in


FULLY_ASYNC = when_flag("--fully-async")


def cpu_threads(ns: argparse.Namespace, cpu_count: int) -> int:
    """Torch threads for each embedded engine and each training worker whose own flag leaves it open. The
    one-step-off and --fully-async loops generate while they train, so each side takes half the cores;
    --synchronous takes turns, so each takes them all (on 2 cores the quickstart's synchronous step took ~21 s at one
    thread each and ~15 s at two)."""
    return max(1, cpu_count if ns.synchronous else cpu_count // 2)


GROUPS = (
    group(
        "rollout data",
        flag(
            "--num-rollout",
            help="rollouts (training steps' worth of data) to run; or give --num-epoch",
            type=int,
            default=None,
            check=at_least(1),
        ),
        flag(
            "--num-epoch",
            help="passes over --prompt-data to run, when --num-rollout is not given",
            type=int,
            default=None,
            check=at_least(1),
        ),
    ),
    group(
        "fully async",
        flag(
            "--synchronous",
            action="store_true",
            help="no overlap: generate each rollout only after the previous step's weights reached the "
            "engines, and run evals between steps too (on-policy with --update-weights-interval 1; on one "
            "machine the engines and the trainer then take turns on all its cores)",
        ),
        flag(
            "--fully-async",
            action="store_true",
            help="a persistent producer keeps groups generating across training steps",
        ),
        flag(
            "--max-staleness-steps",
            "--max-weight-staleness",
            dest="max_staleness_steps",
            type=int,
            default=1,
            check=at_least(0),
            effect_needs=FULLY_ASYNC,
            help="how many policy versions a trained group may lag behind (groups-ahead bound)",
        ),
        flag(
            "--async-max-concurrent-groups",
            type=int,
            default=None,
            effect_needs=FULLY_ASYNC,
            help="groups generating at once (default: rollout-batch-size * (max-staleness-steps + 1))",
        ),
        flag(
            "--rollout-watchdog-seconds",
            type=float,
            default=60.0,
            check=positive(),
            effect_needs=FULLY_ASYNC,
            help="warn when no group finishes for this long",
        ),
        flag(
            "--pause-generation-mode",
            default="in_place",
            choices=("in_place", "abort"),
            help="what in-flight requests do during a weight update: freeze, or return partial output",
        ),
    ),
    group(
        "training",
        flag(
            "--update-weights-interval",
            help="push the trainer's weights to the engines every N rollouts",
            type=int,
            default=1,
            check=at_least(1),
        ),
    ),
    group(
        "critic (--advantage-estimator ppo)",
        flag(
            "--num-critic-only-steps",
            type=int,
            default=0,
            check=at_least(0),
            needs=CRITIC,
            help="train only the critic on the first N rollouts (the actor waits for a useful baseline)",
        ),
    ),
    group(
        "logging and debugging",
        flag(
            "--debug-exit-after-rollout",
            help="stop cleanly after N rollouts of this process (for debugging a launcher)",
            type=int,
            default=None,
            check=at_least(1),
        ),
    ),
)


def _mode(ns: argparse.Namespace) -> str:
    if ns.fully_async:
        return "--fully-async"
    return "--synchronous with --update-weights-interval > 1" if ns.synchronous else "the one-step-off loop"


def default_off_policy_correction(ns: argparse.Namespace) -> list[str]:
    """A run that trains off-policy and names no correction gets --use-tis (on ``ns``), at --tis-clip and
    --tis-clip-low (Miles' defaults, 2 and 0, unless given), named in a warning. Miles' launchers pass none: its
    loop then applies nothing and trains PPO against the recomputed old policy, whose gap to the one that
    generated the samples goes uncorrected; TIS is what Miles applies when asked, and is sound at any staleness."""
    on_policy = ns.synchronous and ns.update_weights_interval == 1
    if ns.use_tis or ns.use_rollout_logprobs or ns.keep_old_actor or on_policy:
        return []
    ns.use_tis = True
    return [
        f"{_mode(ns)} trains on samples generated by an older policy and no off-policy correction was given: "
        f"--use-tis is turned on (truncated importance sampling against the rollout log-probs, at Miles' clip "
        f"--tis-clip {ns.tis_clip} --tis-clip-low {ns.tis_clip_low}); give --use-tis, --use-rollout-logprobs or "
        "--keep-old-actor to choose"
    ]


def validate_async_off_policy_correction(ns: argparse.Namespace) -> None:
    """Every step here trains on samples from an older policy (one-step-off: 1 version behind;
    --fully-async: up to --max-staleness-steps + 1). Which corrections are sound:

    * --use-tis: PPO's old policy is the trainer's weights before the step (recomputed), and
      the engine-to-trainer gap (staleness and numerics) is reweighted by a truncated or
      masked importance ratio (decoupled PPO). Safe at any staleness.
    * --use-rollout-logprobs: the engine's own log-probs are PPO's old policy, so the clip
      bounds the whole gap. Safe; TIS is then the identity and is refused as a no-op.
    * --keep-old-actor: the trainer recomputes log-probs under its kept copy of the weights
      that generated each sample; needs one weight version per trained token of a sample.
      --fully-async generates across weight updates, and an in-place pause carries a request
      on under the new weights, so it needs abort pauses (an aborted sample is regenerated,
      or with --partial-rollout resumed with its off-policy prefix masked).
    Without any of them the update is silently biased: ``default_off_policy_correction`` has turned on
    --use-tis by then."""
    require(
        not (ns.use_rollout_logprobs and ns.use_tis),
        "--use-tis has no effect with --use-rollout-logprobs (the old policy is then the rollout policy, "
        "so every importance weight is 1): drop one",
    )
    require(
        not (ns.use_rollout_logprobs and ns.keep_old_actor),
        "--keep-old-actor and --use-rollout-logprobs both choose PPO's old policy: drop one",
    )
    require(
        not (ns.keep_old_actor and ns.partial_rollout and not ns.mask_offpolicy_in_partial_rollout),
        "--keep-old-actor recomputes each sample under the one weight version that generated it, but "
        "--partial-rollout mixes versions within a sample: add --mask-offpolicy-in-partial-rollout",
    )
    require(
        not (ns.keep_old_actor and ns.fully_async and ns.pause_generation_mode == "in_place"),
        "--fully-async --keep-old-actor needs --pause-generation-mode abort: the default in-place pause "
        "continues a request under the new weights, so one sample holds tokens of two weight versions and "
        "no kept copy generated it. With abort an interrupted sample is generated again (or, with "
        "--partial-rollout --mask-offpolicy-in-partial-rollout, resumed with its older tokens masked); "
        "or use --use-tis instead of --keep-old-actor",
    )


def validate(ns: argparse.Namespace) -> None:
    require(not (ns.synchronous and ns.fully_async), "--synchronous and --fully-async exclude each other")
    validate_async_off_policy_correction(ns)
    if ns.fully_async:
        require(
            ns.update_weights_interval == 1,
            "--fully-async needs --update-weights-interval 1 (the staleness bound counts weight versions)",
        )
        require(
            ns.rollout_function_path is None,
            "--rollout-function-path cannot be used with --fully-async (the producer generates group by group)",
        )
        most = _most_concurrent_groups(ns)
        concurrent = ns.async_max_concurrent_groups or most
        require(
            ns.rollout_batch_size <= concurrent <= most,
            f"--async-max-concurrent-groups {concurrent} must lie between --rollout-batch-size "
            f"{ns.rollout_batch_size} and rollout-batch-size * (max-staleness-steps + 1)",
        )
    require(ns.num_rollout is not None or ns.num_epoch is not None, "give --num-rollout or --num-epoch")
    require(ns.num_rollout is None or ns.num_epoch is None, "give only one of --num-rollout and --num-epoch")


def fully_async_config(ns: argparse.Namespace) -> FullyAsyncConfig | None:
    if not ns.fully_async:
        return None
    return FullyAsyncConfig(
        ns.max_staleness_steps,
        ns.async_max_concurrent_groups or _most_concurrent_groups(ns),
        ns.rollout_watchdog_seconds,
    )


def _most_concurrent_groups(ns: argparse.Namespace) -> int:
    """Groups in flight that the staleness bound allows (the default of --async-max-concurrent-groups)."""
    return ns.rollout_batch_size * (ns.max_staleness_steps + 1)


def num_rollout(ns: argparse.Namespace, num_prompts: int) -> tuple[int, int]:
    """(rollouts in the run, rollouts per epoch of --prompt-data)."""
    per_epoch = num_prompts // ns.rollout_batch_size
    total = ns.num_rollout if ns.num_rollout is not None else ns.num_epoch * per_epoch
    require(
        ns.num_critic_only_steps < total,
        f"--num-critic-only-steps {ns.num_critic_only_steps} leaves no rollout of --num-rollout {total} for the actor",
    )
    return total, per_epoch


def build(ns: argparse.Namespace, total: int, per_epoch: int, start_rollout_id: int) -> LoopConfig:
    return LoopConfig(
        num_rollout=total,
        num_rollout_per_epoch=per_epoch,
        start_rollout_id=start_rollout_id,
        update_weights_interval=ns.update_weights_interval,
        eval_interval=ns.eval_interval,
        debug_exit_after_rollout=ns.debug_exit_after_rollout,
        fully_async=ns.fully_async,
        pause_generation_mode=ns.pause_generation_mode,
        num_critic_only_steps=ns.num_critic_only_steps,
        synchronous=ns.synchronous,
    )
