"""Rollout data, sampling, rewards and plugins: their flags, checks and typed configs."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from miles_async.algorithms import reward_types
from miles_async.config.control import Secret, secret_from
from miles_async.config.declare import (
    Check,
    When,
    at_least,
    each,
    flag,
    given,
    group,
    positive,
    require,
    when_flag,
    within,
)
from miles_async.config.loop import FullyAsyncConfig
from miles_async.config.moe import is_moe
from miles_async.config.multimodal import multimodal_problem, parse_multimodal_keys, validate_multimodal
from miles_async.utils.urls import redact_url


def http_url() -> Check:
    """An http(s) URL with a host (a reward server's address)."""

    def check(name: str, v: str | None) -> str | None:
        if v is None:
            return None
        parts = urlsplit(v)
        if parts.scheme in ("http", "https") and parts.hostname:
            try:
                parts.port  # noqa: B018 - raises on a port that is not a number
                return None
            except ValueError:
                pass
        return f"{name}: {redact_url(v)!r} is not an http(s) URL with a host (e.g. http://localhost:8000/reward)"

    return check


def when_given(name: str) -> When:
    dest = name.lstrip("-").replace("-", "_")
    return When(name, lambda ns: getattr(ns, dest) is not None)


RM_TOKEN_ENV = "MILES_ASYNC_RM_TOKEN"  # the reward server's bearer token, when --rm-token-file is not given
REMOTE_RM_TYPE = "remote_rm"  # Miles/slime's spelling for "score with the server at --rm-url"


def reward_type(name: str, v: str | None) -> str | None:
    """A built-in reward type (``algorithms/reward_types.py``), or Miles' remote_rm."""
    if v is None or v == REMOTE_RM_TYPE:
        return None
    reason = reward_types.problem(v)
    return None if reason is None else f"{name}: {reason}"


PLUGIN_FLAGS = (
    "custom_generate_function_path",
    "rollout_function_path",
    "data_source_path",
    "dynamic_sampling_filter_path",
)
ZERO_VARIANCE_FILTER = "miles_async.rollout.filters.zero_variance"  # what --zero-variance-filter stands for


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``'{"enable_thinking": false}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({{...}})")
    return value


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS (--rollout-stop-token-ids)

    def to_sglang(self) -> dict:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


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
    image_key: str | None = None  # --multimodal-keys' image column: each record's image references
    # --apply-chat-template-kwargs: given to every chat template rendering (prompts, tool turns, evals)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RemoteRewardConfig:
    url: str  # --rm-url
    batch_size: int = 1  # samples per request; 1 posts Miles' single-object shape
    max_concurrent_requests: int = 16
    timeout: float = 60.0  # seconds one request may take
    max_retries: int = 3
    retry_backoff: float = 1.0  # seconds before the first retry, doubling after
    token: Secret | None = None  # sent as "Authorization: Bearer"; --rm-token-file or $MILES_ASYNC_RM_TOKEN


@dataclass(frozen=True)
class RewardConfig:
    rm_type: str | None  # a built-in reward; None with --custom-rm-path or --rm-url
    custom_rm_path: str | None
    on_error: str  # "raise" or "zero"
    remote: RemoteRewardConfig | None = None  # --rm-url
    group_rm: bool = False  # score a prompt's whole group at once (--group-rm)
    reward_key: str | None = None  # a reward returned as an object holds it under this key


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling: which filter judges each group, and how many prompts a draw takes."""

    filter_path: str | None  # None: every group kept (over-sampling alone)
    filter_name: str  # the filter as messages name it: --zero-variance-filter or --dynamic-sampling-filter-path X
    over_sampling_batch_size: int  # prompts per draw in the one-step-off loop
    zero_variance_tol: float  # the built-in filter's tolerance (args.zero_variance_tol for any filter)


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
    dynamic_sampling: DynamicSamplingConfig | None = None  # None: every rollout draws --rollout-batch-size prompts
    return_routed_experts: bool = False  # --use-rollout-routing-replay: samples record each token's experts


GROUPS = (
    group(
        "rollout data",
        flag("--prompt-data", default=None, check=given(), help="JSONL or Parquet prompt file"),
        flag(
            "--input-key",
            help="the prompt's field in each JSONL record (a string, or chat messages with --apply-chat-template)",
            default="prompt",
        ),
        flag("--label-key", help="the field holding the answer the reward compares with", default="label"),
        flag(
            "--metadata-key",
            default="metadata",
            help="the key of each record's metadata object (Miles' default), given to the reward (a reward type "
            "named by its rm_type, choices and correct_letter for gpqa) in rollouts and evals",
        ),
        flag(
            "--apply-chat-template",
            help="wrap each prompt in the tokenizer's chat template (a user turn and the generation prompt)",
            action="store_true",
        ),
        flag(
            "--apply-chat-template-kwargs",
            type=json_object,
            default=None,
            effect_needs=when_flag("--apply-chat-template"),
            help="a JSON object of extra arguments to the chat template, as Miles' '{\"enable_thinking\": false}' "
            "for Qwen3: given to every rendering of it (prompts, evals, multi-turn tool turns)",
        ),
        flag(
            "--multimodal-keys",
            default=None,
            check=lambda name, v: multimodal_problem(name, v),
            help='JSON mapping a modality to the column holding it, as Miles\' \'{"image": "images"}\': each '
            "record's image (a path, relative to the data file's folder or absolute, a data: URI or base64) or list "
            "of them, for a vision-language model's processor",
        ),
        flag(
            "--rollout-max-prompt-len",
            type=int,
            default=None,
            check=at_least(1),
            help="drop prompts longer than this (tokens)",
        ),
        flag(
            "--rollout-shuffle",
            help="shuffle the prompts each epoch (seeded by --rollout-seed; checkpoints keep the order)",
            action="store_true",
        ),
        # A --data-source-path plugin receives the seed with the rest of the data config.
        flag(
            "--rollout-seed",
            help="seed of the prompt order",
            type=int,
            default=42,
            effect_needs=When(
                "--rollout-shuffle or --data-source-path",
                lambda ns: ns.rollout_shuffle or ns.data_source_path is not None,
            ),
        ),
        flag("--rollout-batch-size", type=int, default=None, check=(given(), positive()), help="prompts per rollout"),
        flag(
            "--over-sampling-batch-size",
            type=int,
            default=None,
            check=at_least(1),
            effect_needs=When(
                "the one-step-off or --synchronous loop (the --fully-async producer draws one prompt at a time as "
                "capacity frees up)",
                lambda ns: not ns.fully_async,
            ),
            help="prompts per draw of dynamic sampling (default: --rollout-batch-size): a rollout draws this many "
            "whenever the groups kept and still generating cannot fill --rollout-batch-size, and stops once that "
            "many are kept; the groups still generating then are cancelled and their prompts drawn again next",
        ),
        flag(
            "--n-samples-per-prompt",
            help="responses generated per prompt: the group GRPO compares within",
            type=int,
            default=1,
            check=at_least(1),
        ),
        flag(
            "--rollout-max-response-len",
            help="the most tokens generated per response (all turns together in multi-turn rollouts)",
            type=int,
            default=128,
            check=at_least(1),
        ),
        flag(
            "--rollout-temperature",
            help="sampling temperature of training rollouts",
            type=float,
            default=1.0,
            check=at_least(0),
        ),
        flag(
            "--rollout-top-p",
            help="nucleus sampling of training rollouts (1.0: off)",
            type=float,
            default=1.0,
            check=within(0, 1, low_open=True),
        ),
        flag("--rollout-top-k", help="top-k sampling of training rollouts (-1: off)", type=int, default=-1),
        flag(
            "--rollout-stop-token-ids",
            type=int,
            nargs="+",
            default=None,
            check=each(at_least(0)),
            metavar="ID",
            help="token ids that end a response besides the tokenizer's EOS (kept in the response, as EOS is), "
            "in rollouts and evals",
        ),
        flag(
            "--rollout-max-concurrent-requests",
            help="the most generation requests in flight to the engines at once",
            type=int,
            default=256,
            check=at_least(1),
        ),
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
        flag(
            "--rm-type",
            default=None,
            check=reward_type,
            help=f"a built-in reward type (Miles' reward hub's and the project's): {', '.join(reward_types.TYPES)}, "
            f"each also as {reward_types.BOXED}<type> (scoring only the response's last \\boxed{{...}}); a sample "
            f"whose metadata (--metadata-key) has {reward_types.RM_TYPE_KEY} is scored by that type instead. "
            f"{REMOTE_RM_TYPE} (Miles' spelling) scores with the server at --rm-url",
        ),
        flag(
            "--custom-rm-path",
            default=None,
            help="module:function (or module.function) computing a reward: fn(sample) -> float, or with "
            "--group-rm fn(samples of one prompt) -> list of floats; sync or async",
        ),
        flag(
            "--rm-url",
            default=None,
            check=http_url(),
            help="a reward server (Miles' remote_rm request shape): POSTs {prompt, response, label, metadata} "
            "per sample and reads back the reward (a number, or an object with --reward-key); with "
            "--rm-batch-size > 1 or --group-rm the body is a list of those and the reply a list of rewards",
        ),
        flag(
            "--rm-token-file",
            default=None,
            effect_needs=when_given("--rm-url"),
            help=f"file holding the bearer token sent to --rm-url (else ${RM_TOKEN_ENV}; neither: no token). Never "
            "a flag value, so it stays out of ps and logs",
        ),
        flag(
            "--rm-batch-size",
            type=int,
            default=1,
            check=at_least(1),
            effect_needs=When("--rm-url without --group-rm", lambda ns: ns.rm_url is not None and not ns.group_rm),
            help="samples per request to --rm-url; a batch goes out once full or 50 ms after its first sample",
        ),
        flag(
            "--rm-max-concurrent-requests",
            type=int,
            default=16,
            check=at_least(1),
            effect_needs=when_given("--rm-url"),
            help="requests to --rm-url in flight at once",
        ),
        flag(
            "--rm-timeout",
            type=float,
            default=60.0,
            check=positive(),
            effect_needs=when_given("--rm-url"),
            help="seconds one request to --rm-url may take before it counts as failed (and is retried)",
        ),
        flag(
            "--rm-max-retries",
            type=int,
            default=3,
            check=at_least(0),
            effect_needs=when_given("--rm-url"),
            help="retries of a request to --rm-url that timed out, lost its connection or got a 5xx/408/429, "
            "before the rollout fails naming the URL",
        ),
        flag(
            "--rm-retry-backoff",
            type=float,
            default=1.0,
            check=at_least(0),
            effect_needs=when_given("--rm-url"),
            help="seconds before the first retry to --rm-url; doubles with each further one (at most 30 s)",
        ),
        flag(
            "--group-rm",
            action="store_true",
            needs=When(
                "--custom-rm-path or --rm-url (the built-in rewards score one sample at a time)",
                lambda ns: ns.custom_rm_path is not None or ns.rm_url is not None,
            ),
            help="score each prompt's n samples together (pairwise / ranking reward models): --custom-rm-path "
            "gets the group's list of samples and returns one reward per sample; --rm-url gets one request per group",
        ),
        flag(
            "--reward-key",
            default=None,
            effect_needs=When(
                "--rm-url, --custom-rm-path or --rm-type dapo",
                lambda ns: (
                    ns.rm_url is not None
                    or ns.custom_rm_path is not None
                    or (ns.rm_type or "").removeprefix(reward_types.BOXED) == "dapo"
                ),
            ),
            help="a reward returned as an object (by --rm-url, --custom-rm-path or --rm-type dapo) is read from "
            f"this key (the built-in types' default: {reward_types.REWARD_KEY})",
        ),
        flag(
            "--reward-on-error",
            default="raise",
            choices=("raise", "zero"),
            help="raise: a reward function that raises fails the run, naming the sample; "
            "zero: the sample gets reward 0 and is counted in rollout/reward_errors",
        ),
        flag(
            "--dynamic-sampling-filter-path",
            default=None,
            help="DAPO dynamic sampling: module:function (or module.function) judging each prompt's rewarded group, "
            "Miles/slime's signature fn(args, samples) -> bool or an object with .keep (DynamicFilterOutput); "
            f"dropped groups are replaced by new draws. Built in: {ZERO_VARIANCE_FILTER} (= --zero-variance-filter)",
        ),
        flag(
            "--zero-variance-filter",
            action="store_true",
            help=f"drop groups whose rewards are all equal and keep drawing until a full batch (shorthand for "
            f"--dynamic-sampling-filter-path {ZERO_VARIANCE_FILTER})",
        ),
        flag(
            "--zero-variance-tol",
            type=float,
            default=1e-6,
            check=at_least(0),
            effect_needs=When(
                "--zero-variance-filter or --dynamic-sampling-filter-path",
                lambda ns: ns.zero_variance_filter or ns.dynamic_sampling_filter_path is not None,
            ),
            help="rewards within this of each other count as equal (the filter reads it as args.zero_variance_tol)",
        ),
        flag(
            "--custom-generate-function-path",
            help="module:function generating one sample: async fn(ctx, sample, sampling_params) -> Sample",
            default=None,
        ),
        flag(
            "--rollout-function-path",
            help="module:function producing a whole rollout: async fn(ctx, rollout_id) -> list[list[Sample]]",
            default=None,
        ),
        flag(
            "--data-source-path",
            help="module:class of a data source: cls(data_config, batch_size) with next_batch, state_dict and "
            "load_state_dict",
            default=None,
        ),
    ),
)


def validate(ns: argparse.Namespace) -> None:
    """The reward and the plugins: each imports (a PluginError names the flag otherwise); image prompts' limits."""
    from miles_async.utils.plugins import load_function

    validate_multimodal(ns)

    require(
        ns.rm_type != REMOTE_RM_TYPE or ns.rm_url is not None,
        f"--rm-type {REMOTE_RM_TYPE} needs --rm-url (the reward server's address)",
    )
    given_rewards = [
        name
        for name, value in (
            ("--rm-type", None if ns.rm_type == REMOTE_RM_TYPE else ns.rm_type),
            ("--custom-rm-path", ns.custom_rm_path),
            ("--rm-url", ns.rm_url),
        )
        if value is not None
    ]
    require(
        len(given_rewards) == 1 or ns.rollout_function_path is not None,
        "give exactly one of --rm-type, --custom-rm-path and --rm-url"
        + (f" (given: {', '.join(given_rewards)})" if given_rewards else ""),
    )
    require(
        not (ns.zero_variance_filter and ns.dynamic_sampling_filter_path not in (None, ZERO_VARIANCE_FILTER)),
        f"--zero-variance-filter is --dynamic-sampling-filter-path {ZERO_VARIANCE_FILTER}: give one filter, not "
        f"also --dynamic-sampling-filter-path {ns.dynamic_sampling_filter_path}",
    )
    require(
        ns.data_source_path is None or dynamic_sampling_config(ns) is None or ns.fully_async,
        "--dynamic-sampling-filter-path, --zero-variance-filter and --over-sampling-batch-size need the built-in "
        "data source in the one-step-off loop (it takes back the prompts a rollout drew but did not use); "
        f"--data-source-path {ns.data_source_path} is a plugin",
    )
    for dest in PLUGIN_FLAGS:
        value = getattr(ns, dest)
        if value is not None:
            load_function(value, flag="--" + dest.replace("_", "-"))


def rm_token(ns: argparse.Namespace) -> Secret | None:
    """The reward server's bearer token: --rm-token-file's content, else $MILES_ASYNC_RM_TOKEN, else None."""
    token = secret_from("--rm-token-file", ns.rm_token_file, RM_TOKEN_ENV)
    if token is None:
        return None
    require(
        "@" not in urlsplit(ns.rm_url).netloc,
        f"--rm-url {redact_url(ns.rm_url)} holds credentials and a bearer token is given too "
        f"(--rm-token-file or ${RM_TOKEN_ENV}): give one of them",
    )
    return token


def dynamic_sampling_config(ns: argparse.Namespace) -> DynamicSamplingConfig | None:
    """None when no flag of dynamic sampling is given: each rollout then draws exactly --rollout-batch-size."""
    path = ZERO_VARIANCE_FILTER if ns.zero_variance_filter else ns.dynamic_sampling_filter_path
    if path is None and ns.over_sampling_batch_size is None:
        return None
    name = (
        "--zero-variance-filter"
        if ns.zero_variance_filter
        else f"--dynamic-sampling-filter-path {path}"
        if path is not None
        else "--over-sampling-batch-size"
    )
    return DynamicSamplingConfig(path, name, ns.over_sampling_batch_size or ns.rollout_batch_size, ns.zero_variance_tol)


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
            parse_multimodal_keys(ns.multimodal_keys).get("image"),
            ns.apply_chat_template_kwargs or {},
        ),
        reward=RewardConfig(
            None if ns.rm_type == REMOTE_RM_TYPE else ns.rm_type,
            ns.custom_rm_path,
            ns.reward_on_error,
            remote=RemoteRewardConfig(
                ns.rm_url,
                ns.rm_batch_size,
                ns.rm_max_concurrent_requests,
                ns.rm_timeout,
                ns.rm_max_retries,
                ns.rm_retry_backoff,
                rm_token(ns),
            )
            if ns.rm_url is not None
            else None,
            group_rm=ns.group_rm,
            reward_key=ns.reward_key,
        ),
        sampling=SamplingConfig(
            ns.rollout_temperature,
            ns.rollout_top_p,
            ns.rollout_top_k,
            ns.rollout_max_response_len,
            tuple(ns.rollout_stop_token_ids or ()),
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
        dynamic_sampling=dynamic_sampling_config(ns),
        return_routed_experts=ns.use_rollout_routing_replay and is_moe(ns),
    )
