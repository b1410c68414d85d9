"""The command-line flags: one argparse parser, grouped as a launcher groups them.

Miles/slime names where a flag exists there. Only the definitions live here;
``miles_async.arguments`` validates the parsed values and builds the typed configs.
"""

from __future__ import annotations

import argparse

from miles_async.config import ESTIMATORS

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
    g.add_argument("--rollout-backend", default="embedded", choices=("embedded", "sglang", "vllm"),
                   help="embedded: the project's own CPU engine server; sglang: SGLang's server "
                        "(python -m sglang.launch_server, in SGLang's environment: scripts/setup_sglang_env.sh); "
                        "vllm: vLLM's server (vllm.entrypoints.openai.api_server, in vLLM's environment: "
                        "scripts/setup_vllm_env.sh). Any --sglang-<flag> [value] / --vllm-<flag> [value] not listed "
                        "here goes to that server as --<flag> [value], e.g. --sglang-mem-fraction-static 0.7, "
                        "--vllm-gpu-memory-utilization 0.7")
    g.add_argument("--sglang-python", default=None,
                   help="python of SGLang's environment (default: $MILES_ASYNC_SGLANG_PYTHON, else "
                        "~/.cache/miles-async/venv-sglang/bin/python if present, else this python)")
    g.add_argument("--vllm-python", default=None,
                   help="python of vLLM's environment (default: $MILES_ASYNC_VLLM_PYTHON, else "
                        "~/.cache/miles-async/venv-vllm/bin/python if present, else this python)")
    g.add_argument("--weight-update-dir", default=None,
                   help="--rollout-backend sglang / vllm: where the trainer writes the weights the engines load "
                        "(/update_weights_from_disk); default a folder in /dev/shm when present, else the output dir")
    g.add_argument("--weight-update-method", default="auto", choices=("auto", "tensor", "disk", "distributed"),
                   help="how a weight update reaches the engines. tensor: buckets of tensors over HTTP (the embedded "
                        "engine; SGLang on the trainer's node: shared-memory / CUDA IPC handles, "
                        "/update_weights_from_tensor); disk: an HF folder the engines load (SGLang, vLLM); distributed: broadcast from the "
                        "trainer's rank 0 in a process group with the engines, NCCL on GPUs, gloo on the CPU (SGLang's "
                        "update_weights_from_distributed). auto: tensor for embedded, distributed for sglang, disk "
                        "for vllm")
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
