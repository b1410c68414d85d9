"""Flags that Miles', slime's and Megatron-LM's published launchers pass and that have no effect here.

Each is accepted, so a launcher runs as written, and each one given is named once in a warning that says why it
does nothing (``declare.flag(..., ignored=...)``). ``--colocate`` is the exception: asynchronous training cannot
share GPUs between the trainer and the engines, so it is refused, as Miles' train_async.py refuses it.
"""

from __future__ import annotations

from typing import Any

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


GROUPS = (
    group(
        "cluster",
        flag(
            "--colocate",
            action="store_true",
            check=_refuse_colocate,
            help="refused: asynchronous training keeps the trainer and the engines on separate GPUs",
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
    group(
        "accepted from Miles, slime and Megatron-LM launchers (no effect here)",
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
    ),
)
