"""Flags that Miles', slime's and Megatron-LM's launchers pass and that do not take effect here.

Each parses, so a launcher never stops at "unrecognized arguments". A flag that is harmless to drop (logging,
memory management, kernel switches, colocated-mode offload) is accepted and named once in a warning that says
why it does nothing (``declare.flag(..., ignored=...)``). A flag that changes what Miles computes and has no
implementation here is refused when given, with what is missing or what to use instead (``refused=...``):
silently dropping it would train something else. ``--colocate`` is refused too: asynchronous training cannot
share GPUs between the trainer and the engines, as Miles' train_async.py says.
"""

from __future__ import annotations

from typing import Any

from miles_async.config.compat_refused import (
    CHECKS,
    DUMP,
    KERNEL,
    MEMORY,
    PROFILE,
    REFUSED,
    ROUTER,
    TELEMETRY,
    TITLE,
    ignored,
)
from miles_async.config.declare import flag, group

MOE_ROUTER = (
    "where the router's softmax sits is config.json's (norm_topk_prob false: before the top-k, as "
    "--moe-router-pre-softmax; true, and Mixtral: over the top-k)"
)
OFFLOAD = "Miles' colocated-mode memory management; here the trainer and the engines never share a GPU"
PACKING = "micro-batches are packed to --max-tokens-per-gpu tokens (Miles' --use-dynamic-batch-size)"
FUSION = "a Megatron-LM kernel-fusion switch; the backend sets its own fusions"
WANDB = "log in with `wandb login` or WANDB_API_KEY / WANDB_BASE_URL / WANDB_ENTITY"


def _refuse_colocate(name: str, value: bool) -> str | None:
    return (
        (
            f"{name} is not supported for asynchronous training: the engines generate rollout N+1 while the trainer "
            f"trains on rollout N, so they cannot share GPUs (Miles' train_async.py refuses it too). Drop {name} "
            f"and give the engines their own GPUs (--rollout-num-gpus)"
        )
        if value
        else None
    )


def _switch(name: str, why: str):
    return flag(name, action="store_true", ignored=why)


def _value(name: str, why: str, type_: Any = str, nargs: str | None = None):
    options: dict[str, Any] = {"type": type_, "default": None}
    if nargs:
        options["nargs"] = nargs
    return flag(name, ignored=why, **options)


IGNORED = (
    *ignored(
        "Megatron's weights go to the engines through mbridge's conversion tables here (Miles' bridge mode); the "
        "engines receive the same HF weights in either mode",
        "--megatron-to-hf-mode=",
    ),
    *ignored("the converter is chosen by config.json's model_type", "--model-name="),
    *ignored("every --save-interval checkpoint is kept here; none is deleted", "--save-retain-interval="),
    *ignored(
        "the W&B run is named --wandb-run-name as given; no random suffix is added here",
        "--disable-wandb-random-suffix",
    ),
    *ignored("set WANDB_MODE / WANDB_DIR in the environment; W&B reads them", "--wandb-mode=", "--wandb-dir="),
    *ignored(
        "each metric's x axis in W&B is its own step key here (rollout or train step)", "--wandb-always-use-train-step"
    ),
    *ignored("TensorBoard's folder is --tensorboard-dir", "--tb-project-name=", "--tb-experiment-name="),
    *ignored(
        "MLflow is not a tracker here (--use-wandb, --use-tensorboard)",
        "--use-mlflow",
        "--mlflow-experiment-name=",
        "--mlflow-run-id=",
        "--mlflow-run-name=",
        "--mlflow-tracking-uri=",
    ),
    *ignored(
        TELEMETRY,
        "--use-miles-dashboard",
        "--dashboard-gpu-sample-interval=",
        "--dashboard-sglang-scrape-mode=",
        "--dashboard-sglang-scrape-interval=",
        "--dashboard-sglang-metrics=",
        "--dashboard-flush-interval=",
        "--dashboard-forward-prometheus",
        "--use-prometheus",
        "--prometheus-port=",
        "--prometheus-run-name=",
        "--mfu-peak-tflops=",
        "--env-report=",
    ),
    *ignored(
        "an extra log line of Miles' that is not written here",
        "--log-multi-turn",
        "--log-correct-samples",
        "--log-reward-category=",
        "--log-passrate",
        "--get-mismatch-metrics",
        "--observe-training-entropy",
        "--use-rollout-entropy",
    ),
    *ignored(
        DUMP,
        "--dump-details=",
        "--save-debug-train-data=",
        "--save-debug-trajectory-data=",
        "--save-debug-event-data=",
        "--dumper-enable",
        "--dumper-dir=",
        "--dumper-inference*",
        "--dumper-fwd-only*",
        "--dumper-fwd-bwd*",
        "--dumper-source-patcher-config-inference=",
        "--dumper-source-patcher-config-train=",
    ),
    *ignored(
        PROFILE,
        "--use-pytorch-profiler",
        "--profile-step-start=",
        "--profile-step-end=",
        "--profile-target+",
        "--record-memory-history",
        "--memory-recorder=",
        "--memory-snapshot-dir=",
        "--memory-snapshot-num-steps=",
        "--memory-snapshot-path=",
    ),
    *ignored(
        CHECKS,
        "--ci-test",
        "--ci-check-model-hash",
        "--ci-save-model-hash",
        "--ci-disable-kl-checker",
        "--ci-disable-logprobs-checker",
        "--ci-disable-weight-update-checker",
        "--ci-metric-checker-key=",
        "--ci-metric-checker-threshold=",
        "--ci-save-grad-norm=",
        "--ci-load-grad-norm=",
        "--enable-event-analyzer",
        "--enable-witness",
        "--witness-buffer-size=",
        "--save-local-weight-checksum",
        "--check-rematerialize-param-from-master-weight",
        "--ci-train-rollout-logprob-abs-diff-threshold=",
        "--debug-deterministic-collective",
    ),
    *ignored(
        "--check-weight-update-equal compares every weight exactly here",
        "--check-weight-update-selector=",
        "--check-weight-update-skip-list*",
        "--check-weight-update-allow-quant-error",
        "--check-lora-weight-equal",
    ),
    *ignored(
        OFFLOAD,
        "--offload",
        "--offload-train-target=",
        "--offload-train-disk-dir=",
        "--offload-train-disk-chunk-mb=",
        "--rematerialize-param-from-master-weight",
        "--lora-base-cpu-backup",
        "--stream-optimizer-state-to-disk",
        "--release-train",
    ),
    *ignored(
        MEMORY,
        "--recompute-loss-function",
        "--log-probs-max-tokens-per-gpu=",
        "--fsdp-state-dict-cpu-offload",
        "--fsdp-cpu-backend=",
        "--dp-replicate-size=",
    ),
    *ignored(PACKING, "--balance-by-flops", "--data-pad-size-multiplier=", "--delay-split-train-data-by-dp"),
    *ignored(
        KERNEL,
        "--attn-implementation=",
        "--qkv-format=",
        "--allgather-cp",
        "--cp-comm-type=",
        "--linear-attention-backend=",
        "--use-flash-attn",
        "--moe-flex-dispatcher-backend=",
        "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--use-distributed-post",
        "--qwen-gdn-backend=",
    ),
    *ignored("the trainer's collectives keep the backend's own timeout", "--distributed-timeout-minutes="),
    *ignored(
        "the rollout executor (Miles' rollout manager) is a Ray actor Ray places; where it runs changes no result",
        "--pin-rollout-manager-to-head",
    ),
    *ignored(
        "engines and reward servers are reached directly here, through no proxy",
        "--http-proxy=",
    ),
    *ignored(
        "an engine's health is checked once it has started (--engine-startup-timeout bounds the start)",
        "--rollout-health-check-first-wait=",
    ),
    *ignored("the disk weight files are removed once the engines have loaded them", "--update-weight-disk-keep-files"),
    *ignored(
        ROUTER,
        "--use-miles-router",
        "--miles-router-health-check-failure-threshold=",
        "--miles-router-max-connections=",
        "--miles-router-timeout=",
        "--router-policy=",
        "--router-prefill-policy=",
        "--router-decode-policy=",
        "--router-assignment-mode=",
        "--router-health-check-interval-secs=",
        "--router-health-failure-threshold=",
        "--router-health-success-threshold=",
    ),
    *ignored(
        "rollout data passes between processes through Ray's object store here",
        "--object-store-backend=",
        "--rollout-data-transport=",
        "--mooncake-replica-num=",
        "--mooncake-store-init-kwargs=",
    ),
)


GROUPS = (
    group(
        "cluster",
        flag(
            "--colocate",
            action="store_true",
            check=_refuse_colocate,
            refused="asynchronous training keeps the trainer and the engines on separate GPUs",
        ),
        _value(
            "--num-gpus-per-node", "the GPUs of each group are --actor-num-gpus-per-node and --rollout-num-gpus", int
        ),
        _value("--train-memory-margin-bytes", OFFLOAD, int),
        _switch("--offload-train", OFFLOAD),
        _switch("--no-offload-train", OFFLOAD),
        _switch("--offload-rollout", OFFLOAD),
        _switch("--no-offload-rollout", OFFLOAD),
        _value("--offload-rollout-level", OFFLOAD, nargs="+"),
    ),
    REFUSED,
    group(
        TITLE,
        _switch(
            "--balance-data",
            "each optimizer step's samples are dealt to the data-parallel ranks in turn; "
            "micro-batches are then packed by tokens",
        ),
        _value("--micro-batch-size", PACKING, int),
        _value("--seq-length", PACKING + "; each sample keeps its own length", int),
        _value("--log-probs-chunk-size", "log-probs are computed per packed micro-batch", int),
        _switch(
            "--calculate-per-token-loss",
            "the loss is aggregated by --loss-agg-mode (token_mean by default: per token over the whole step)",
        ),
        _value("--loss-mask-type", "the loss mask comes with each sample from its generation"),
        _switch("--no-check-for-nan-in-loss-and-grad", "a non-finite loss is not checked separately here"),
        _switch("--no-gradient-accumulation-fusion", FUSION),
        _switch("--no-rope-fusion", FUSION),
        _switch("--no-masked-softmax-fusion", FUSION),
        _value(
            "--spec",
            "the layer spec is Transformer Engine's when it is installed, else Megatron's local one",
            nargs="+",
        ),
        _value(
            "--transformer-impl",
            "the layer spec is Transformer Engine's when it is installed, else Megatron's local one",
        ),
        _value("--wandb-key", WANDB),
        _value("--wandb-host", WANDB),
        _value("--wandb-team", WANDB),
        _value("--wandb-run-id", "the run's name is --wandb-run-name"),
        _switch("--moe-router-pre-softmax", MOE_ROUTER),
        _switch("--moe-shared-expert-gate", "the shared expert's sigmoid gate is config.json's (Qwen2-MoE has one)"),
        _switch(
            "--moe-enable-deepep",
            "DeepEP is what --moe-token-dispatcher-type flex dispatches with (megatron-core's default backend)",
        ),
        *IGNORED,
    ),
)
