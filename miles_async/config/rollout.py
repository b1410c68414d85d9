"""Rollout data, sampling, rewards and plugins: their flags, checks and typed configs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.declare import (
    When,
    at_least,
    flag,
    given,
    group,
    positive,
    require,
    when_flag,
    within,
)
from miles_async.config.loop import FullyAsyncConfig

RM_TYPES = ("math", "integer", "exact", "first_integer")
PLUGIN_FLAGS = ("custom_generate_function_path", "rollout_function_path", "data_source_path")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    def to_sglang(self) -> dict:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }


@dataclass(frozen=True)
class DataConfig:
    path: str
    input_key: str
    label_key: str
    metadata_key: str | None
    apply_chat_template: bool
    max_prompt_len: int | None
    shuffle: bool
    seed: int


@dataclass(frozen=True)
class RewardConfig:
    rm_type: str | None
    custom_rm_path: str | None
    on_error: str  # "raise" or "zero"


@dataclass(frozen=True)
class RolloutConfig:
    data: DataConfig
    reward: RewardConfig
    sampling: SamplingConfig
    tokenizer_path: str
    rollout_batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
    max_concurrent_requests: int
    custom_generate_function_path: str | None
    rollout_function_path: str | None
    data_source_path: str | None
    fully_async: FullyAsyncConfig | None = None
    timeout: float = 1800.0  # --rollout-timeout: seconds one rollout (and one eval) may take
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False


GROUPS = (
    group(
        "rollout data",
        flag("--prompt-data", default=None, check=given(), help="JSONL or Parquet prompt file"),
        flag("--input-key", default="prompt"),
        flag("--label-key", default="label"),
        flag("--metadata-key", default=None),
        flag("--apply-chat-template", action="store_true"),
        flag(
            "--rollout-max-prompt-len",
            type=int,
            default=None,
            check=at_least(1),
            help="drop prompts longer than this (tokens)",
        ),
        flag("--rollout-shuffle", action="store_true"),
        # A --data-source-path plugin receives the seed with the rest of the data config.
        flag(
            "--rollout-seed",
            type=int,
            default=42,
            effect_needs=When(
                "--rollout-shuffle or --data-source-path",
                lambda ns: ns.rollout_shuffle or ns.data_source_path is not None,
            ),
        ),
        flag("--rollout-batch-size", type=int, default=None, check=(given(), positive()), help="prompts per rollout"),
        flag("--n-samples-per-prompt", type=int, default=1, check=at_least(1)),
        flag("--rollout-max-response-len", type=int, default=128, check=at_least(1)),
        flag("--rollout-temperature", type=float, default=1.0, check=at_least(0)),
        flag("--rollout-top-p", type=float, default=1.0, check=within(0, 1, low_open=True)),
        flag("--rollout-top-k", type=int, default=-1),
        flag("--rollout-max-concurrent-requests", type=int, default=256, check=at_least(1)),
        flag(
            "--rollout-timeout",
            type=float,
            default=1800.0,
            check=positive(),
            help="seconds one rollout may take before the run fails",
        ),
    ),
    group(
        "fully async",
        flag(
            "--partial-rollout",
            action="store_true",
            help="continue a sample aborted by a weight update from its tokens instead of regenerating it "
            "(only abort-mode pauses abort samples)",
        ),
        flag(
            "--mask-offpolicy-in-partial-rollout",
            action="store_true",
            needs=when_flag("--partial-rollout", why="without it no sample mixes weight versions across an abort"),
            help="loss mask 0 on tokens from weights older than the sample's newest; needs --partial-rollout",
        ),
    ),
    group(
        "rewards and plugins",
        flag("--rm-type", default=None, choices=RM_TYPES),
        flag("--custom-rm-path", default=None, help="module:function (or module.function) computing a reward"),
        flag(
            "--reward-on-error",
            default="raise",
            choices=("raise", "zero"),
            help="raise: a reward function that raises fails the run, naming the sample; "
            "zero: the sample gets reward 0 and is counted in rollout/reward_errors",
        ),
        flag("--custom-generate-function-path", default=None),
        flag("--rollout-function-path", default=None),
        flag("--data-source-path", default=None),
    ),
)


def validate(ns: argparse.Namespace) -> None:
    """The reward and the plugins: each imports (a PluginError names the flag otherwise)."""
    from miles_async.utils.plugins import load_function

    require(
        (ns.rm_type is None) != (ns.custom_rm_path is None) or ns.rollout_function_path is not None,
        "give exactly one of --rm-type and --custom-rm-path",
    )
    for dest in PLUGIN_FLAGS:
        value = getattr(ns, dest)
        if value is not None:
            load_function(value, flag="--" + dest.replace("_", "-"))


def build(ns: argparse.Namespace, fully_async: FullyAsyncConfig | None) -> RolloutConfig:
    return RolloutConfig(
        data=DataConfig(
            ns.prompt_data,
            ns.input_key,
            ns.label_key,
            ns.metadata_key,
            ns.apply_chat_template,
            ns.rollout_max_prompt_len,
            ns.rollout_shuffle,
            ns.rollout_seed,
        ),
        reward=RewardConfig(ns.rm_type, ns.custom_rm_path, ns.reward_on_error),
        sampling=SamplingConfig(
            ns.rollout_temperature, ns.rollout_top_p, ns.rollout_top_k, ns.rollout_max_response_len
        ),
        tokenizer_path=ns.hf_checkpoint,
        rollout_batch_size=ns.rollout_batch_size,
        n_samples_per_prompt=ns.n_samples_per_prompt,
        max_concurrent_requests=ns.rollout_max_concurrent_requests,
        custom_generate_function_path=ns.custom_generate_function_path,
        rollout_function_path=ns.rollout_function_path,
        data_source_path=ns.data_source_path,
        fully_async=fully_async,
        timeout=ns.rollout_timeout,
        partial_rollout=ns.partial_rollout,
        mask_offpolicy_in_partial_rollout=ns.mask_offpolicy_in_partial_rollout,
    )
