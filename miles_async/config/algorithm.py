"""The RL algorithm (advantage estimator, policy loss, KL, importance sampling): flags, checks and the typed
``AlgorithmConfig``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.algorithms import ESTIMATORS
from miles_async.config.declare import (
    When,
    above,
    at_least,
    flag,
    group,
    positive,
    require,
    when_flag,
    when_value,
    within,
)


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage_estimator: str
    normalize_std: bool
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    loss_type: str
    loss_agg_mode: str
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    use_rollout_logprobs: bool
    tis_level: str = "token"  # "token" | "sequence"
    tis_mode: str = "truncate"  # "truncate" | "mask" (icepop: drop tokens whose ratio leaves the band)
    kl_coef: float = 0.0  # KL to the reference model as a per-token reward penalty (ppo, reinforce++)
    gamma: float = 1.0
    lambd: float = 1.0
    value_clip: float | None = 0.2
    normalize_advantages: bool = False
    keep_old_actor: bool = False  # PPO's old policy = the trainer's copy of the weights that generated the data

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "ppo"

    @property
    def needs_ref_model(self) -> bool:
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0


PPO = when_value("--advantage-estimator", "ppo")
CRITIC = when_value("--advantage-estimator", "ppo", why="the only estimator with a critic")
USE_TIS = when_flag("--use-tis")
USE_KL_LOSS = when_flag("--use-kl-loss")

GROUPS = (
    group(
        "critic (--advantage-estimator ppo)",
        flag(
            "--value-clip",
            type=float,
            default=0.2,
            check=at_least(0, " (0 turns it off)"),
            effect_needs=PPO,
            help="PPO value clipping; 0 turns it off",
        ),
    ),
    group(
        "algorithm",
        flag(
            "--advantage-estimator",
            default="grpo",
            choices=ESTIMATORS,
            help="gspo = GRPO advantages with the sequence-level ratio loss; ppo trains a critic (GAE)",
        ),
        flag(
            "--disable-grpo-std-normalization",
            action="store_true",
            effect_needs=when_value("--advantage-estimator", "grpo", "gspo"),
            help="Dr. GRPO: centre, do not scale",
        ),
        flag("--normalize-advantages", action="store_true", help="whiten ppo's GAE advantages over the batch"),
        flag(
            "--gamma",
            type=float,
            default=1.0,
            check=within(0, 1),
            effect_needs=when_value("--advantage-estimator", "reinforce_plus_plus", "ppo"),
            help="discount (reinforce_plus_plus, ppo)",
        ),
        flag("--lambd", type=float, default=1.0, check=within(0, 1), effect_needs=PPO, help="GAE lambda (ppo)"),
        flag(
            "--kl-coef",
            type=float,
            default=0.0,
            check=at_least(0),
            help="KL to --ref-load as a per-token reward penalty (reinforce_plus_plus, ppo)",
        ),
        flag(
            "--eps-clip",
            help="PPO's clip range of the ratio: [1 - eps, 1 + eps]",
            type=float,
            default=0.2,
            check=positive(),
        ),
        flag(
            "--eps-clip-high",
            help="the clip's upper bound, 1 + this (DAPO's clip-higher; default: --eps-clip)",
            type=float,
            default=None,
        ),
        flag(
            "--eps-clip-c",
            help="dual clip: bound the loss of negative-advantage tokens at this times the advantage (> 1)",
            type=float,
            default=None,
            check=above(1, " (the dual clip's lower bound)"),
        ),
        flag(
            "--policy-loss-type",
            default=None,
            choices=("ppo", "gspo", "cispo"),
            help="default: gspo for --advantage-estimator gspo, else ppo",
        ),
        flag(
            "--loss-agg-mode",
            help="how token losses are averaged: over all tokens, per sequence then over sequences, or summed per "
            "sequence",
            default="token_mean",
            choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"),
        ),
        flag(
            "--use-kl-loss",
            help="add a KL penalty to the reference model (--ref-load) to the loss",
            action="store_true",
            effect_needs=When("--kl-loss-coef > 0", lambda ns: ns.kl_loss_coef > 0),
        ),
        flag("--kl-loss-coef", help="weight of the KL loss", type=float, default=0.0, effect_needs=USE_KL_LOSS),
        flag(
            "--kl-loss-type",
            help="the KL estimator of the KL loss",
            default="low_var_kl",
            choices=("k1", "k2", "k3", "low_var_kl"),
            effect_needs=USE_KL_LOSS,
        ),
        flag("--entropy-coef", help="weight of the entropy bonus", type=float, default=0.0),
        flag("--use-tis", action="store_true", help="truncated importance sampling against rollout log-probs"),
        flag(
            "--tis-clip",
            help="upper bound of the truncated importance weight (old / rollout policy)",
            type=float,
            default=2.0,
            effect_needs=USE_TIS,
        ),
        flag(
            "--tis-clip-low",
            help="lower bound of the truncated importance weight",
            type=float,
            default=0.0,
            effect_needs=USE_TIS,
        ),
        flag(
            "--tis-level",
            default="token",
            choices=("token", "sequence"),
            effect_needs=USE_TIS,
            help="importance ratio per token or per sequence (product over its tokens)",
        ),
        flag(
            "--tis-mode",
            default="truncate",
            choices=("truncate", "mask"),
            effect_needs=USE_TIS,
            help="truncate the ratio into [tis-clip-low, tis-clip], or mask tokens whose ratio leaves it (icepop)",
        ),
        flag(
            "--keep-old-actor",
            action="store_true",
            help="PPO's old policy = the trainer's copy of the weights that generated each sample "
            "(kept on the CPU per weight version), instead of the weights before this step",
        ),
        flag("--use-rollout-logprobs", action="store_true", help="use the engine's log-probs as the PPO old policy"),
    ),
)


def loss_type(ns: argparse.Namespace) -> str:
    return ns.policy_loss_type or ("gspo" if ns.advantage_estimator == "gspo" else "ppo")


def validate(ns: argparse.Namespace) -> None:
    require(ns.tis_clip > ns.tis_clip_low >= 0, "--tis-clip must be > --tis-clip-low >= 0")
    require(
        not (ns.use_kl_loss and ns.ref_load is None and ns.kl_loss_coef > 0),
        "--use-kl-loss with --kl-loss-coef > 0 needs --ref-load (the reference model)",
    )
    require(
        ns.kl_coef == 0 or ns.advantage_estimator in ("ppo", "reinforce_plus_plus"),
        f"--kl-coef puts the KL into per-token rewards, which only ppo and reinforce_plus_plus use; "
        f"with --advantage-estimator {ns.advantage_estimator} use --use-kl-loss",
    )
    require(ns.kl_coef == 0 or ns.ref_load is not None, "--kl-coef > 0 needs --ref-load (the reference model)")
    require(
        ns.advantage_estimator != "gspo" or ns.policy_loss_type in (None, "gspo"),
        f"--advantage-estimator gspo is the sequence-level ratio loss; --policy-loss-type "
        f"{ns.policy_loss_type} contradicts it",
    )
    require(
        ns.eps_clip_c is None or loss_type(ns) != "cispo",
        "--eps-clip-c (dual clip) is not defined for --policy-loss-type cispo, which has no clipped surrogate "
        "to bound: drop one",
    )
    require(
        not ns.normalize_advantages or ns.advantage_estimator == "ppo",
        "--normalize-advantages applies to ppo's GAE (the other estimators normalise on their own)",
    )


def build(ns: argparse.Namespace) -> AlgorithmConfig:
    return AlgorithmConfig(
        advantage_estimator=ns.advantage_estimator,
        normalize_std=not ns.disable_grpo_std_normalization,
        eps_clip=ns.eps_clip,
        eps_clip_high=ns.eps_clip_high if ns.eps_clip_high is not None else ns.eps_clip,
        eps_clip_c=ns.eps_clip_c,
        loss_type=loss_type(ns),
        loss_agg_mode=ns.loss_agg_mode,
        use_kl_loss=ns.use_kl_loss,
        kl_loss_coef=ns.kl_loss_coef,
        kl_loss_type=ns.kl_loss_type,
        entropy_coef=ns.entropy_coef,
        use_tis=ns.use_tis,
        tis_clip=ns.tis_clip,
        tis_clip_low=ns.tis_clip_low,
        use_rollout_logprobs=ns.use_rollout_logprobs,
        tis_level=ns.tis_level,
        tis_mode=ns.tis_mode,
        kl_coef=ns.kl_coef,
        gamma=ns.gamma,
        lambd=ns.lambd,
        value_clip=ns.value_clip or None,
        normalize_advantages=ns.normalize_advantages,
        keep_old_actor=ns.keep_old_actor,
    )
