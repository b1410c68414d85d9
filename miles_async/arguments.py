"""Command-line flags (Miles/slime names where they exist) -> validated ``Config``.

Every error raised here happens before any Ray worker or engine starts and names the
flag, file or line at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

import yaml

from miles_async.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    ESTIMATORS,
    Config,
    DataConfig,
    EngineConfig,
    EvalConfig,
    FaultToleranceConfig,
    FullyAsyncConfig,
    LoopConfig,
    MegatronConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TrackingConfig,
    TrainConfig,
)


class ConfigError(ValueError):
    """A flag, file or combination of flags is invalid."""


RM_TYPES = ("math", "integer", "exact", "first_integer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_async.py",
        description="Asynchronous RL post-training: rollout N+1 is generated while step N trains.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file of flag values (keys use - or _); command-line flags win")

    g = p.add_argument_group("cluster")
    g.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting a local one")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="training workers per node (CPU processes when no GPU is present)")
    g.add_argument("--train-num-threads", type=int, default=None,
                   help="torch threads per training worker (default: half the cores)")
    g.add_argument("--rollout-num-threads", type=int, default=None,
                   help="torch threads per embedded engine (default: half the cores)")

    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--hf-checkpoint", required=False, default=None, help="HF model folder the policy starts from")
    g.add_argument("--ref-load", default=None, help="HF folder of the reference model for the KL loss")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from (its latest complete iteration)")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--save-hf", default=None, help="write the final policy as an HF folder here")
    g.add_argument("--save-trigger-sentinel", default=None,
                   help="when this file exists after a step, save then delete it (preemption)")
    g.add_argument("--no-save-optim", action="store_true")

    g = p.add_argument_group("rollout data")
    g.add_argument("--prompt-data", default=None, help="JSONL or Parquet prompt file")
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--label-key", default="label")
    g.add_argument("--metadata-key", default=None)
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None, help="drop prompts longer than this (tokens)")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, default=None)
    g.add_argument("--num-epoch", type=int, default=None)
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=int, default=1)
    g.add_argument("--rollout-max-response-len", type=int, default=128)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-max-concurrent-requests", type=int, default=256)
    g.add_argument("--rollout-timeout", type=float, default=1800.0,
                   help="seconds one rollout may take before the run fails")

    g = p.add_argument_group("fully async")
    g.add_argument("--synchronous", action="store_true",
                   help="no overlap: generate each rollout only after the previous step's weights reached the "
                        "engines (on-policy with --update-weights-interval 1; the baseline the async modes beat)")
    g.add_argument("--fully-async", action="store_true",
                   help="a persistent producer keeps groups generating across training steps")
    g.add_argument("--max-staleness-steps", "--max-weight-staleness", dest="max_staleness_steps", type=int,
                   default=1, help="how many policy versions a trained group may lag behind (groups-ahead bound)")
    g.add_argument("--async-max-concurrent-groups", type=int, default=None,
                   help="groups generating at once (default: rollout-batch-size * (max-staleness-steps + 1))")
    g.add_argument("--zero-variance-filter", action="store_true",
                   help="drop groups whose rewards are all equal and keep pulling until a full batch")
    g.add_argument("--zero-variance-tol", type=float, default=1e-6)
    g.add_argument("--rollout-watchdog-seconds", type=float, default=60.0,
                   help="warn when no group finishes for this long")
    g.add_argument("--pause-generation-mode", default="in_place", choices=("in_place", "abort"),
                   help="what in-flight requests do during a weight update: freeze, or return partial output")
    g.add_argument("--partial-rollout", action="store_true",
                   help="continue a sample aborted by a weight update from its tokens instead of regenerating it "
                        "(only abort-mode pauses abort samples)")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="loss mask 0 on tokens from weights older than the sample's newest; needs --partial-rollout")

    g = p.add_argument_group("rewards and plugins")
    g.add_argument("--rm-type", default=None, choices=RM_TYPES)
    g.add_argument("--custom-rm-path", default=None, help="module:function (or module.function) computing a reward")
    g.add_argument("--reward-on-error", default="raise", choices=("raise", "zero"),
                   help="raise: a reward function that raises fails the run, naming the sample; "
                        "zero: the sample gets reward 0 and is counted in rollout/reward_errors")
    g.add_argument("--custom-generate-function-path", default=None)
    g.add_argument("--rollout-function-path", default=None)
    g.add_argument("--data-source-path", default=None)

    g = p.add_argument_group("inference engines")
    g.add_argument("--rollout-backend", default="embedded", choices=("embedded", "sglang"),
                   help="embedded: the project's own CPU engine server; sglang: SGLang's server "
                        "(python -m sglang.launch_server, in SGLang's environment: scripts/setup_sglang_env.sh). "
                        "Any --sglang-<flag> [value] not listed here goes to SGLang as --<flag> [value], e.g. "
                        "--sglang-mem-fraction-static 0.7, --sglang-attention-backend fa3")
    g.add_argument("--sglang-python", default=None,
                   help="python of SGLang's environment (default: $MILES_ASYNC_SGLANG_PYTHON, else "
                        "~/.cache/miles-async/venv-sglang/bin/python if present, else this python)")
    g.add_argument("--weight-update-dir", default=None,
                   help="--rollout-backend sglang: where the trainer writes the weights the engines load "
                        "(/update_weights_from_disk); default a folder in /dev/shm when present, else the output dir")
    g.add_argument("--rollout-num-gpus", type=int, default=1, help="engine slots in all")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    g.add_argument("--rollout-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g.add_argument("--sglang-server-concurrency", type=int, default=64,
                   help="max running requests per engine")
    g.add_argument("--engine-host", default="127.0.0.1")
    g.add_argument("--engine-startup-timeout", type=float, default=600.0)
    g.add_argument("--engine-request-timeout", type=float, default=600.0)
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="bytes per weight bucket")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="health-check the engines; one that dies or stops answering is taken out of the router, "
                        "its requests are retried on the others, and it is restarted with the current weights "
                        "(copied from a serving engine). Without it a dead engine fails the run")
    g.add_argument("--rollout-health-check-interval", type=float, default=10.0,
                   help="seconds between health checks (--use-fault-tolerance)")
    g.add_argument("--rollout-health-check-timeout", type=float, default=5.0,
                   help="seconds a health check may take before it counts as failed")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="restarts per engine over the run before it is given up (the run fails once no engine "
                        "is left)")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="after every weight update, compare a checksum of each engine's weights with the "
                        "trainer's (in the engine dtype) and fail naming the first tensor that differs")
    g.add_argument("--rollout-router", default="builtin", choices=("builtin", "sglang"),
                   help="builtin: least outstanding requests (with --use-fault-tolerance: retries on engine "
                        "failure); sglang: SGLang's own router, needs sglang-router (untested)")

    g = p.add_argument_group("eval")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                   help="pairs of name and file (a single PATH is named 'eval')")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=0.0)
    g.add_argument("--eval-top-p", type=float, default=1.0)
    g.add_argument("--eval-max-response-len", type=int, default=None)
    g.add_argument("--skip-eval-before-train", action="store_true")
    g.add_argument("--max-in-flight-evals", type=int, default=1)

    g = p.add_argument_group("training")
    g.add_argument("--train-backend", default="fsdp", choices=("fsdp", "megatron"),
                   help="fsdp: HF transformers models under torch DDP; megatron: Megatron-core GPTModel "
                        "(pip install -r requirements-megatron.txt)")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision: autocast matmuls, fp32 weights and optimizer")
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step")
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="token budget of one micro-batch")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--update-weights-interval", type=int, default=1)

    g = p.add_argument_group("megatron (--train-backend megatron)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="only 1 for now")
    g.add_argument("--context-parallel-size", type=int, default=1, help="only 1 for now")
    g.add_argument("--sequence-parallel", action="store_true", help="needs --tensor-model-parallel-size > 1")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks")

    g = p.add_argument_group("critic (--advantage-estimator ppo)")
    g.add_argument("--critic-load", default=None, help="HF folder the critic starts from (default: --hf-checkpoint; "
                                                       "its value head starts random)")
    g.add_argument("--critic-num-nodes", type=int, default=None, help="default: --actor-num-nodes")
    g.add_argument("--critic-num-gpus-per-node", type=int, default=None, help="default: --actor-num-gpus-per-node")
    g.add_argument("--critic-lr", type=float, default=None, help="default: --lr")
    g.add_argument("--critic-lr-warmup-iters", type=int, default=None, help="default: --lr-warmup-iters")
    g.add_argument("--num-critic-only-steps", type=int, default=0,
                   help="train only the critic on the first N rollouts (the actor waits for a useful baseline)")
    g.add_argument("--value-clip", type=float, default=0.2, help="PPO value clipping; 0 turns it off")

    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", default="constant", choices=("constant", "linear", "cosine"))
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.98)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", default="grpo", choices=ESTIMATORS,
                   help="gspo = GRPO advantages with the sequence-level ratio loss; ppo trains a critic (GAE)")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr. GRPO: centre, do not scale")
    g.add_argument("--normalize-advantages", action="store_true", help="whiten ppo's GAE advantages over the batch")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (reinforce_plus_plus, ppo)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL to --ref-load as a per-token reward penalty (reinforce_plus_plus, ppo)")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None)
    g.add_argument("--policy-loss-type", default=None, choices=("ppo", "gspo", "cispo"),
                   help="default: gspo for --advantage-estimator gspo, else ppo")
    g.add_argument("--loss-agg-mode", default="token_mean",
                   choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"))
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", default="low_var_kl", choices=("k1", "k2", "k3", "low_var_kl"))
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling against rollout log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--tis-level", default="token", choices=("token", "sequence"),
                   help="importance ratio per token or per sequence (product over its tokens)")
    g.add_argument("--tis-mode", default="truncate", choices=("truncate", "mask"),
                   help="truncate the ratio into [tis-clip-low, tis-clip], or mask tokens whose ratio leaves it "
                        "(icepop)")
    g.add_argument("--keep-old-actor", action="store_true",
                   help="PPO's old policy = the trainer's copy of the weights that generated each sample "
                        "(kept on the CPU per weight version), instead of the weights before this step")
    g.add_argument("--use-rollout-logprobs", action="store_true",
                   help="use the engine's log-probs as the PPO old policy")

    g = p.add_argument_group("logging and debugging")
    g.add_argument("--output-dir", default=None, help="metrics JSONL, plot and logs (default: outputs/<time>)")
    g.add_argument("--use-wandb", action="store_true")
    g.add_argument("--wandb-project", default="miles-async")
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--use-tensorboard", action="store_true")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--debug-exit-after-rollout", type=int, default=None)
    # Controlled costs for benchmarks/: training replaced by a sleep (the batch still reaches every
    # worker), and a fixed cost added to each engine decode step.
    g.add_argument("--debug-train-seconds", type=float, default=None, help=argparse.SUPPRESS)
    g.add_argument("--debug-engine-step-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def _apply_yaml_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return
    path = Path(known.config)
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    dests = {a.dest for a in parser._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in dests:
            raise ConfigError(f"--config: {path}: unknown flag '{key}'")
        defaults[dest] = value
    # YAML values become defaults, so anything given on the command line still wins.
    parser.set_defaults(**defaults)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate_async_off_policy_correction(ns: argparse.Namespace) -> None:
    """Every step here trains on samples from an older policy (one-step-off: 1 version behind;
    --fully-async: up to --max-staleness-steps + 1). Which corrections are sound:

    * --use-tis: PPO's old policy is the trainer's weights before the step (recomputed), and
      the engine-to-trainer gap (staleness and numerics) is reweighted by a truncated or
      masked importance ratio (decoupled PPO). Safe at any staleness.
    * --use-rollout-logprobs: the engine's own log-probs are PPO's old policy, so the clip
      bounds the whole gap. Safe; TIS is then the identity and is refused as a no-op.
    * --keep-old-actor: the trainer recomputes log-probs under its kept copy of the weights
      that generated each sample; needs one weight version per sample, so a partial
      rollout must mask its off-policy prefix.
    Without any of them the update is silently biased, so the run is refused."""
    on_policy = ns.synchronous and ns.update_weights_interval == 1
    if not (ns.use_tis or ns.use_rollout_logprobs or ns.keep_old_actor or on_policy):
        mode = "--fully-async" if ns.fully_async else "--synchronous with --update-weights-interval > 1" \
            if ns.synchronous else "the one-step-off loop"
        raise ConfigError(f"{mode} trains on samples generated by an older policy: add --use-tis (truncated "
                          "importance sampling against the rollout log-probs), --use-rollout-logprobs or "
                          "--keep-old-actor")
    _require(not (ns.use_rollout_logprobs and ns.use_tis),
             "--use-tis has no effect with --use-rollout-logprobs (the old policy is then the rollout policy, "
             "so every importance weight is 1): drop one")
    _require(not (ns.use_rollout_logprobs and ns.keep_old_actor),
             "--keep-old-actor and --use-rollout-logprobs both choose PPO's old policy: drop one")
    _require(not (ns.keep_old_actor and ns.partial_rollout and not ns.mask_offpolicy_in_partial_rollout),
             "--keep-old-actor recomputes each sample under the one weight version that generated it, but "
             "--partial-rollout mixes versions within a sample: add --mask-offpolicy-in-partial-rollout")


def _validate_algorithm(ns: argparse.Namespace) -> None:
    uses_critic = ns.advantage_estimator == "ppo"
    _require(0 <= ns.gamma <= 1, "--gamma must lie in [0, 1]")
    _require(0 <= ns.lambd <= 1, "--lambd must lie in [0, 1]")
    _require(ns.value_clip >= 0, "--value-clip must be >= 0 (0 turns it off)")
    _require(ns.kl_coef >= 0, "--kl-coef must be >= 0")
    _require(ns.kl_coef == 0 or ns.advantage_estimator in ("ppo", "reinforce_plus_plus"),
             f"--kl-coef puts the KL into per-token rewards, which only ppo and reinforce_plus_plus use; "
             f"with --advantage-estimator {ns.advantage_estimator} use --use-kl-loss")
    _require(ns.kl_coef == 0 or ns.ref_load is not None, "--kl-coef > 0 needs --ref-load (the reference model)")
    _require(ns.advantage_estimator != "gspo" or ns.policy_loss_type in (None, "gspo"),
             f"--advantage-estimator gspo is the sequence-level ratio loss; --policy-loss-type "
             f"{ns.policy_loss_type} contradicts it")
    _require(not ns.normalize_advantages or uses_critic,
             "--normalize-advantages applies to ppo's GAE (the other estimators normalise on their own)")
    for flag in ("critic_load", "critic_num_nodes", "critic_num_gpus_per_node", "critic_lr", "critic_lr_warmup_iters"):
        _require(getattr(ns, flag) is None or uses_critic,
                 f"--{flag.replace('_', '-')} needs --advantage-estimator ppo (the only estimator with a critic)")
    _require(ns.num_critic_only_steps == 0 or uses_critic, "--num-critic-only-steps needs --advantage-estimator ppo")
    _require(ns.num_critic_only_steps >= 0, "--num-critic-only-steps must be >= 0")
    _require(ns.critic_load is None or Path(ns.critic_load).is_dir(), f"--critic-load: not a folder: {ns.critic_load}")
    _require(ns.critic_lr is None or ns.critic_lr > 0, "--critic-lr must be positive")


def _validate_megatron(ns: argparse.Namespace, num_workers: int) -> MegatronConfig:
    """The Megatron flags: refused with the torch backend, checked against the model and the workers."""
    mcfg = MegatronConfig(ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size,
                          ns.sequence_parallel, ns.use_distributed_optimizer)
    if ns.train_backend != "megatron":
        _require(mcfg == MegatronConfig(), "--tensor-model-parallel-size, --pipeline-model-parallel-size, "
                                           "--context-parallel-size, --sequence-parallel and "
                                           "--use-distributed-optimizer need --train-backend megatron")
        return mcfg
    import importlib.util
    import json

    _require(importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None,
             "--train-backend megatron needs megatron-core: pip install -r requirements-megatron.txt")
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    _require(min(tp, pp, cp) >= 1, "Megatron parallel sizes must be >= 1")
    _require(pp == 1, "--pipeline-model-parallel-size > 1 is not supported by the megatron backend yet (weight "
                      "export and the micro-batch path assume one pipeline stage)")
    _require(cp == 1, "--context-parallel-size > 1 is not supported by the megatron backend yet (log-probs are "
                      "gathered from whole sequences)")
    _require(num_workers % mcfg.model_parallel_size == 0,
             f"{num_workers} training workers do not split into TP {tp} x PP {pp} x CP {cp} model-parallel groups")
    _require(not ns.sequence_parallel or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    _require(not ns.sequence_parallel or importlib.util.find_spec("transformer_engine") is not None,
             "--sequence-parallel needs Transformer Engine (Megatron's local layer spec uses torch norms, which "
             "refuse sequence parallelism)")
    config = json.loads((Path(ns.hf_checkpoint) / "config.json").read_text())
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    _require(heads % tp == 0 and kv_heads % tp == 0,
             f"--tensor-model-parallel-size {tp} must divide the model's {heads} attention heads and "
             f"{kv_heads} key/value heads")
    _require(ns.advantage_estimator != "ppo", "--advantage-estimator ppo needs a critic, which the megatron backend "
                                              "does not have yet: use --train-backend fsdp")
    _require(not ns.keep_old_actor, "--keep-old-actor is not supported by the megatron backend yet: use --use-tis "
                                    "or --use-rollout-logprobs")
    _require(not ns.gradient_checkpointing, "--gradient-checkpointing is not mapped to Megatron's recompute yet")
    return mcfg


def _parse_eval_datasets(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    if not values:
        return ()
    if len(values) == 1:
        return (("eval", values[0]),)
    _require(len(values) % 2 == 0, "--eval-prompt-data takes NAME PATH pairs (or a single PATH)")
    return tuple((values[i], values[i + 1]) for i in range(0, len(values), 2))


def _default_threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    _apply_yaml_config(parser, argv)
    ns, unknown = parser.parse_known_args(argv)
    ns.sglang_args = _sglang_passthrough(parser, unknown)
    return build_config(ns)


def _sglang_passthrough(parser: argparse.ArgumentParser, unknown: list[str]) -> tuple[str, ...]:
    """``--sglang-<flag> [value]`` not declared here becomes SGLang's ``--<flag> [value]``; anything else unknown
    is an error, as with ``parse_args``."""
    out: list[str] = []
    i = 0
    while i < len(unknown):
        arg = unknown[i]
        if not arg.startswith("--sglang-"):
            parser.error(f"unrecognized arguments: {' '.join(unknown[i:])}")
        name, eq, value = arg.partition("=")
        out.append("--" + name[len("--sglang-"):])
        if eq:
            out.append(value)
        elif i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
            out.append(unknown[i + 1])
            i += 1
        i += 1
    return tuple(out)


def build_config(ns: argparse.Namespace) -> Config:
    """Validate the namespace and split it into per-component configs."""
    # Imported here so parsing flags stays cheap for --help.
    from miles_async.rollout.data_source import count_and_validate_prompts
    from miles_async.rollout.rewards import validate_reward_flags
    from miles_async.utils.checkpoint import latest_checkpointed_iteration
    from miles_async.utils.plugins import load_function

    _require(ns.hf_checkpoint is not None, "--hf-checkpoint is required (an HF model folder)")
    _require(Path(ns.hf_checkpoint).is_dir(), f"--hf-checkpoint: not a folder: {ns.hf_checkpoint}")
    _require(ns.prompt_data is not None, "--prompt-data is required")
    _require(ns.rollout_batch_size is not None and ns.rollout_batch_size > 0,
             "--rollout-batch-size must be given and positive")
    _require(ns.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be >= 1")
    _require(ns.rollout_max_response_len >= 1, "--rollout-max-response-len must be >= 1")
    _require(ns.rollout_temperature >= 0, "--rollout-temperature must be >= 0")
    _require(0 < ns.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]")
    _require(ns.update_weights_interval >= 1, "--update-weights-interval must be >= 1")
    _require(ns.max_tokens_per_gpu >= 1, "--max-tokens-per-gpu must be >= 1")
    _require(ns.lr > 0, "--lr must be positive")
    _require(ns.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")
    _require(ns.eps_clip > 0, "--eps-clip must be positive")
    _require(ns.eps_clip_c is None or ns.eps_clip_c > 1, "--eps-clip-c (dual clip) must be > 1")
    _require(ns.tis_clip > ns.tis_clip_low >= 0, "--tis-clip must be > --tis-clip-low >= 0")
    _require(ns.update_weight_buffer_size > 0, "--update-weight-buffer-size must be positive")
    _require(ns.rollout_num_gpus_per_engine >= 1, "--rollout-num-gpus-per-engine must be >= 1")
    _require(ns.rollout_num_gpus >= ns.rollout_num_gpus_per_engine,
             "--rollout-num-gpus must be >= --rollout-num-gpus-per-engine")
    _require(ns.save_interval is None or ns.save_interval >= 1, "--save-interval must be >= 1")
    _require(ns.save_interval is None or ns.save is not None, "--save-interval needs --save")
    _require(ns.save_trigger_sentinel is None or ns.save is not None, "--save-trigger-sentinel needs --save")
    _require(ns.eval_interval is None or ns.eval_interval >= 1, "--eval-interval must be >= 1")
    _require(ns.eval_interval is None or ns.eval_prompt_data, "--eval-interval needs --eval-prompt-data")
    _require(ns.max_in_flight_evals >= 1, "--max-in-flight-evals must be >= 1")
    _require(not (ns.use_kl_loss and ns.ref_load is None and ns.kl_loss_coef > 0),
             "--use-kl-loss with --kl-loss-coef > 0 needs --ref-load (the reference model)")
    _require(ns.ref_load is None or Path(ns.ref_load).is_dir(), f"--ref-load: not a folder: {ns.ref_load}")
    _require(ns.debug_exit_after_rollout is None or ns.debug_exit_after_rollout >= 1,
             "--debug-exit-after-rollout must be >= 1")
    _require((ns.rm_type is None) != (ns.custom_rm_path is None) or ns.rollout_function_path is not None,
             "give exactly one of --rm-type and --custom-rm-path")
    validate_reward_flags(ns.rm_type, ns.custom_rm_path)
    import importlib.util

    _require(not ns.use_wandb or importlib.util.find_spec("wandb") is not None,
             "--use-wandb needs the wandb package: pip install 'miles_async[wandb]'")
    for flag in ("custom_generate_function_path", "rollout_function_path", "data_source_path"):
        value = getattr(ns, flag)
        if value is not None:
            load_function(value, flag="--" + flag.replace("_", "-"))

    num_prompts = count_and_validate_prompts(ns.prompt_data, ns.input_key, ns.label_key, flag="--prompt-data")
    _require(num_prompts >= ns.rollout_batch_size,
             f"--prompt-data has {num_prompts} prompts, fewer than --rollout-batch-size {ns.rollout_batch_size}")
    eval_datasets = _parse_eval_datasets(ns.eval_prompt_data)
    for name, path in eval_datasets:
        count_and_validate_prompts(path, ns.input_key, ns.label_key, flag=f"--eval-prompt-data ({name})")

    _require(ns.partial_rollout or not ns.mask_offpolicy_in_partial_rollout,
             "--mask-offpolicy-in-partial-rollout needs --partial-rollout (without it no sample mixes weight "
             "versions across an abort)")
    fully_async = None
    _require(not (ns.synchronous and ns.fully_async), "--synchronous and --fully-async exclude each other")
    _require(ns.debug_train_seconds is None or ns.debug_train_seconds >= 0, "--debug-train-seconds must be >= 0")
    _require(ns.debug_engine_step_seconds >= 0, "--debug-engine-step-seconds must be >= 0")
    validate_async_off_policy_correction(ns)
    _validate_algorithm(ns)
    if ns.fully_async:
        _require(ns.update_weights_interval == 1, "--fully-async needs --update-weights-interval 1 (the staleness "
                                                  "bound counts weight versions)")
        _require(ns.max_staleness_steps >= 0, "--max-staleness-steps must be >= 0")
        _require(ns.rollout_function_path is None, "--rollout-function-path cannot be used with --fully-async "
                                                   "(the producer generates group by group)")
        concurrent = ns.async_max_concurrent_groups or ns.rollout_batch_size * (ns.max_staleness_steps + 1)
        _require(ns.rollout_batch_size <= concurrent <= ns.rollout_batch_size * (ns.max_staleness_steps + 1),
                 f"--async-max-concurrent-groups {concurrent} must lie between --rollout-batch-size "
                 f"{ns.rollout_batch_size} and rollout-batch-size * (max-staleness-steps + 1)")
        fully_async = FullyAsyncConfig(ns.max_staleness_steps, concurrent, ns.zero_variance_filter,
                                       ns.zero_variance_tol, ns.rollout_watchdog_seconds)
    else:
        _require(not ns.zero_variance_filter, "--zero-variance-filter needs --fully-async for now")

    samples_per_rollout = ns.rollout_batch_size * ns.n_samples_per_prompt
    if ns.global_batch_size is None and ns.num_steps_per_rollout is None:
        num_steps, global_batch = 1, samples_per_rollout
    elif ns.global_batch_size is None:
        num_steps = ns.num_steps_per_rollout
        _require(num_steps >= 1 and samples_per_rollout % num_steps == 0,
                 f"--num-steps-per-rollout {num_steps} must divide rollout-batch-size * n-samples-per-prompt "
                 f"= {samples_per_rollout}")
        global_batch = samples_per_rollout // num_steps
    else:
        global_batch = ns.global_batch_size
        _require(global_batch >= 1, "--global-batch-size must be >= 1")
        _require(global_batch <= samples_per_rollout,
                 f"--global-batch-size {global_batch} is larger than one rollout "
                 f"(--rollout-batch-size * --n-samples-per-prompt = {samples_per_rollout})")
        _require(samples_per_rollout % global_batch == 0,
                 f"--global-batch-size {global_batch} must divide rollout-batch-size * n-samples-per-prompt "
                 f"= {samples_per_rollout}")
        num_steps = samples_per_rollout // global_batch
        _require(ns.num_steps_per_rollout is None or ns.num_steps_per_rollout == num_steps,
                 f"--num-steps-per-rollout {ns.num_steps_per_rollout} contradicts --global-batch-size "
                 f"{global_batch} (which gives {num_steps})")

    num_rollout_per_epoch = num_prompts // ns.rollout_batch_size
    if ns.num_rollout is None:
        _require(ns.num_epoch is not None, "give --num-rollout or --num-epoch")
        _require(ns.num_epoch >= 1, "--num-epoch must be >= 1")
        num_rollout = ns.num_epoch * num_rollout_per_epoch
    else:
        _require(ns.num_epoch is None, "give only one of --num-rollout and --num-epoch")
        num_rollout = ns.num_rollout
    _require(num_rollout >= 1, "--num-rollout must be >= 1")

    start_rollout_id = 0
    if ns.load is not None:
        _require(Path(ns.load).is_dir(), f"--load: not a folder: {ns.load}")
        last = latest_checkpointed_iteration(ns.load)
        _require(last is not None, f"--load: no complete checkpoint in {ns.load}")
        start_rollout_id = last + 1
    _require(start_rollout_id < num_rollout,
             f"--load: the checkpoint already reached rollout {start_rollout_id - 1} of --num-rollout {num_rollout}")

    num_workers = ns.actor_num_nodes * ns.actor_num_gpus_per_node
    _require(num_workers >= 1, "--actor-num-nodes * --actor-num-gpus-per-node must be >= 1")
    megatron = _validate_megatron(ns, num_workers)
    data_parallel = num_workers // megatron.model_parallel_size
    _require(global_batch % data_parallel == 0,
             f"the global batch ({global_batch} samples) must split evenly over {data_parallel} data-parallel "
             f"training workers")
    num_critic_workers = 0
    if ns.advantage_estimator == "ppo":
        num_critic_workers = (ns.critic_num_nodes or ns.actor_num_nodes) * \
            (ns.critic_num_gpus_per_node or ns.actor_num_gpus_per_node)
        _require(num_critic_workers >= 1, "--critic-num-nodes * --critic-num-gpus-per-node must be >= 1")
        _require(global_batch % num_critic_workers == 0,
                 f"the global batch ({global_batch} samples) must split evenly over {num_critic_workers} critic "
                 f"workers")
        _require(ns.num_critic_only_steps < num_rollout,
                 f"--num-critic-only-steps {ns.num_critic_only_steps} leaves no rollout of --num-rollout "
                 f"{num_rollout} for the actor")
    use_gpu = _cuda_available()
    threads = _default_threads()

    engine = EngineConfig(
        backend=ns.rollout_backend,
        model_path=ns.hf_checkpoint,
        num_engines=ns.rollout_num_gpus // ns.rollout_num_gpus_per_engine,
        dtype=ns.rollout_dtype,
        max_running_requests=ns.sglang_server_concurrency,
        num_threads=ns.rollout_num_threads or threads,
        host=ns.engine_host,
        startup_timeout=ns.engine_startup_timeout,
        request_timeout=ns.engine_request_timeout,
        seed=ns.seed,
        debug_step_seconds=ns.debug_engine_step_seconds,
        fault_tolerance=_fault_tolerance_config(ns),
        check_weight_update_equal=ns.check_weight_update_equal,
        router=ns.rollout_router,
        sglang_python=ns.sglang_python,
        sglang_args=tuple(getattr(ns, "sglang_args", ())),
        num_gpus_per_engine=ns.rollout_num_gpus_per_engine,
        use_gpu=use_gpu,
        weight_update_dir=ns.weight_update_dir,
    )
    rollout_sampling = SamplingConfig(ns.rollout_temperature, ns.rollout_top_p, ns.rollout_top_k,
                                      ns.rollout_max_response_len)
    rollout = RolloutConfig(
        data=DataConfig(ns.prompt_data, ns.input_key, ns.label_key, ns.metadata_key, ns.apply_chat_template,
                        ns.rollout_max_prompt_len, ns.rollout_shuffle, ns.rollout_seed),
        reward=RewardConfig(ns.rm_type, ns.custom_rm_path, ns.reward_on_error),
        sampling=rollout_sampling,
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
    eval_cfg = EvalConfig(
        datasets=eval_datasets,
        interval=ns.eval_interval,
        n_samples_per_prompt=ns.n_samples_per_eval_prompt,
        sampling=SamplingConfig(ns.eval_temperature, ns.eval_top_p, -1,
                                ns.eval_max_response_len or ns.rollout_max_response_len),
        skip_before_train=ns.skip_eval_before_train,
        max_in_flight=ns.max_in_flight_evals,
        input_key=ns.input_key,
        label_key=ns.label_key,
    )
    algorithm = AlgorithmConfig(
        advantage_estimator=ns.advantage_estimator,
        normalize_std=not ns.disable_grpo_std_normalization,
        eps_clip=ns.eps_clip,
        eps_clip_high=ns.eps_clip_high if ns.eps_clip_high is not None else ns.eps_clip,
        eps_clip_c=ns.eps_clip_c,
        loss_type=ns.policy_loss_type or ("gspo" if ns.advantage_estimator == "gspo" else "ppo"),
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
    optimizer = OptimizerConfig(ns.lr, ns.min_lr, ns.lr_warmup_iters, ns.lr_decay_style, ns.weight_decay,
                                ns.adam_beta1, ns.adam_beta2, ns.adam_eps, ns.clip_grad)
    train = TrainConfig(
        backend=ns.train_backend,
        model_path=ns.hf_checkpoint,
        ref_model_path=ns.ref_load,
        dtype="bfloat16" if ns.bf16 else "float32",
        global_batch_size=global_batch,
        num_steps_per_rollout=num_steps,
        max_tokens_per_gpu=ns.max_tokens_per_gpu,
        algorithm=algorithm,
        optimizer=optimizer,
        update_weight_buffer_size=ns.update_weight_buffer_size,
        gradient_checkpointing=ns.gradient_checkpointing,
        seed=ns.seed,
        num_threads=ns.train_num_threads or threads,
        debug_train_seconds=ns.debug_train_seconds,
        max_kept_weight_versions=(ns.max_staleness_steps if ns.fully_async else 1) + 2,
        megatron=megatron,
    )
    critic = None
    if algorithm.uses_critic:
        critic = dataclasses.replace(
            train, role="critic", model_path=ns.critic_load or ns.hf_checkpoint, ref_model_path=None,
            optimizer=dataclasses.replace(optimizer, lr=ns.critic_lr or ns.lr,
                                          min_lr=min(ns.min_lr, ns.critic_lr or ns.lr),
                                          lr_warmup_iters=ns.lr_warmup_iters if ns.critic_lr_warmup_iters is None
                                          else ns.critic_lr_warmup_iters))
    output_dir = ns.output_dir or os.path.join("outputs", _timestamp())
    return Config(
        cluster=ClusterConfig(ns.ray_address, num_workers, train.num_threads, engine.num_threads, use_gpu,
                              num_critic_workers),
        engine=engine,
        rollout=rollout,
        eval=eval_cfg,
        train=train,
        checkpoint=CheckpointConfig(ns.save, ns.load, ns.save_interval, ns.save_hf, ns.save_trigger_sentinel,
                                    ns.no_save_optim),
        tracking=TrackingConfig(output_dir, ns.use_wandb, ns.wandb_project, ns.wandb_group, ns.wandb_run_name,
                                ns.use_tensorboard, ns.tensorboard_dir, not ns.no_plot),
        loop=LoopConfig(
            num_rollout=num_rollout,
            num_rollout_per_epoch=num_rollout_per_epoch,
            start_rollout_id=start_rollout_id,
            update_weights_interval=ns.update_weights_interval,
            eval_interval=ns.eval_interval,
            save_interval=ns.save_interval,
            debug_exit_after_rollout=ns.debug_exit_after_rollout,
            rollout_timeout=ns.rollout_timeout,
            fully_async=ns.fully_async,
            pause_generation_mode=ns.pause_generation_mode,
            num_critic_only_steps=ns.num_critic_only_steps,
            synchronous=ns.synchronous,
        ),
        critic=critic,
    )


def _fault_tolerance_config(ns: argparse.Namespace) -> FaultToleranceConfig | None:
    import importlib.util

    _require(ns.rollout_health_check_interval > 0, "--rollout-health-check-interval must be positive")
    _require(ns.rollout_health_check_timeout > 0, "--rollout-health-check-timeout must be positive")
    _require(ns.max_engine_restarts >= 0, "--max-engine-restarts must be >= 0")
    _require(not ns.check_weight_update_equal or ns.train_backend == "fsdp",
             "--check-weight-update-equal is implemented for --train-backend fsdp only")
    _require(ns.rollout_router != "sglang" or importlib.util.find_spec("sglang_router") is not None,
             "--rollout-router sglang needs the sglang_router package: pip install sglang-router")
    _require(not (ns.use_fault_tolerance and ns.rollout_router == "sglang"),
             "--use-fault-tolerance works with --rollout-router builtin only for now")
    if ns.rollout_backend == "sglang":
        _require(not ns.use_fault_tolerance, "--use-fault-tolerance works with --rollout-backend embedded only for "
                                             "now (a restarted engine is seeded through /get_weights)")
        _require(not ns.check_weight_update_equal, "--check-weight-update-equal needs the embedded engine's "
                                                   "/weights_checksum; not available with --rollout-backend sglang")
    if not ns.use_fault_tolerance:
        return None
    return FaultToleranceConfig(ns.rollout_health_check_interval, ns.rollout_health_check_timeout,
                                ns.max_engine_restarts)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _timestamp() -> str:
    import time

    return time.strftime("%Y%m%d-%H%M%S")
