"""Megatron's MoE layers (--train-backend megatron on an MoE checkpoint): the flags Miles' MoE launchers pass for
the router, load balancing and token dispatch, the typed ``MoEConfig`` they fill, and which MoE families the backend
builds.

The architecture of the MoE layers (--num-experts, --moe-router-topk, --moe-ffn-hidden-size, --moe-layer-freq,
--moe-shared-expert-intermediate-size, --moe-router-score-function) is config.json's and is checked against it with
the other architecture flags (``model.py``). Names and defaults are Megatron-LM's. Grouped GEMM and the fused
permutation are Transformer Engine's GPU kernels: without Transformer Engine they stay off, with a warning, and the
experts run one matmul each (megatron-core's SequentialMLP), which computes the same function.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.declare import When, at_least, flag, group
from miles_async.config.hf_to_megatron import EXPERT_BIAS
from miles_async.config.machine import Machine
from miles_async.config.model import hf_config_json

# The MoE families the megatron backend builds, and for others what it would need (in the error).
BUILT = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
MISSING = {
    "deepseek_v2": (
        "DeepSeek-V2's router (softmax scores, each expert group ranked by its best expert, which megatron-core's "
        "group-limited top-k does not do)"
    ),
    "kimi_k2": (
        "a transformers model for model_type kimi_k2 (Kimi-K2's modeling code is remote code; its architecture is "
        "DeepSeek-V3's, which the backend builds from a config.json with model_type deepseek_v3)"
    ),
    "minimax_m2": "MiniMax's sigmoid router with an expert-score bias",
}


def not_built(model_type: str) -> str:
    """Why the megatron backend refuses an MoE family it does not build."""
    missing = MISSING.get(model_type, "a mapping of its MoE block")
    return (
        f"--train-backend megatron does not build model_type {model_type!r} (it builds the MoE families "
        f"{', '.join(BUILT)}): missing {missing}; --train-backend fsdp trains it as an HF model"
    )


@dataclass(frozen=True)
class MoEConfig:
    """What the --moe-* flags set on megatron-core's MoE layers (TransformerConfig's moe_* fields)."""

    router_dtype: str | None = None  # "fp32" | "fp64": the router's matmul and softmax; None: the model's dtype
    aux_loss_coeff: float = 0.0
    load_balancing_type: str = "aux_loss"
    token_dispatcher_type: str = "allgather"
    expert_capacity_factor: float | None = None  # None: dropless
    token_drop_policy: str = "probs"
    grouped_gemm: bool = False  # requested; only Transformer Engine's kernel honours it
    permute_fusion: bool = False
    bias_update_rate: float = 1e-3  # how fast an expert-bias router's bias follows the experts' loads


def is_moe(ns: argparse.Namespace) -> bool:
    """--hf-checkpoint's config.json describes an MoE model."""
    hf = hf_config_json(ns)
    return bool(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"))


def _has_expert_bias(ns: argparse.Namespace) -> bool:
    return hf_config_json(ns).get("model_type") in EXPERT_BIAS


MOE_MODEL = When(
    "--train-backend megatron on an MoE model (experts in --hf-checkpoint's config.json)",
    lambda ns: ns.train_backend == "megatron" and is_moe(ns),
)
CAPACITY = When(
    "--moe-expert-capacity-factor (without a capacity no token is dropped)",
    lambda ns: MOE_MODEL.holds(ns) and ns.moe_expert_capacity_factor is not None,
)
EXPERT_BIAS_MODEL = When(
    "--train-backend megatron on a model whose router has an expert bias (GLM-4.5, DeepSeek-V3)",
    lambda ns: MOE_MODEL.holds(ns) and _has_expert_bias(ns),
)
_TE_KERNEL = "Transformer Engine's GPU kernel; without Transformer Engine it stays off"
ANY_MOE_MODEL = When("an MoE model (experts in --hf-checkpoint's config.json)", is_moe)
ROUTING_REPLAY = flag(
    "--use-rollout-routing-replay",
    action="store_true",
    effect_needs=ANY_MOE_MODEL,
    help="rollout routing replay (R3, slime's flag): the engine returns the experts its router chose for every "
    "token, and the trainer's policy passes (old log-probs and training) route each token to those experts instead "
    "of their own top-k; the router still gets gradients through the replayed experts' weights. Both training "
    "backends; the embedded and SGLang engines",
)

GROUPS = (
    group(
        "megatron (--train-backend megatron)",
        flag(
            "--moe-router-dtype",
            default=None,
            choices=("fp32", "fp64"),
            effect_needs=MOE_MODEL,
            help="dtype of the router's logits and softmax (default: the model's)",
        ),
        flag(
            "--moe-router-load-balancing-type",
            help="MoE: the router's load-balancing loss",
            default="aux_loss",
            choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
            effect_needs=MOE_MODEL,
        ),
        flag(
            "--moe-aux-loss-coeff",
            type=float,
            default=0.0,
            check=at_least(0.0),
            effect_needs=MOE_MODEL,
            help="weight of the load-balancing loss; Miles' launchers give 0. Expert-parallel ranks come out of "
            "data parallelism, so a per-rank aux loss differs from the unparallel one by design",
        ),
        flag(
            "--moe-token-dispatcher-type",
            default="allgather",
            choices=("allgather", "alltoall", "flex"),
            effect_needs=MOE_MODEL,
            help="how tokens reach the expert-parallel ranks owning their experts; flex needs DeepEP (GPUs)",
        ),
        flag(
            "--moe-expert-capacity-factor",
            type=float,
            default=None,
            check=at_least(0.0),
            effect_needs=MOE_MODEL,
            help="tokens an expert takes, as a multiple of its even share; default: no limit (dropless)",
        ),
        flag(
            "--moe-token-drop-policy",
            default="probs",
            choices=("probs", "position"),
            effect_needs=CAPACITY,
            help="which tokens an expert over its capacity drops",
        ),
        flag(
            "--moe-router-bias-update-rate",
            type=float,
            default=1e-3,
            check=at_least(0.0),
            effect_needs=EXPERT_BIAS_MODEL,
            help="how far each step moves the router's expert bias toward balanced loads (Megatron-LM's "
            "aux-loss-free balancing); Miles' RL launchers give 0, which keeps the checkpoint's bias. A moved bias "
            "reaches the engines with the weights",
        ),
        flag("--moe-grouped-gemm", action="store_true", effect_needs=MOE_MODEL, help=_TE_KERNEL),
        flag("--moe-permute-fusion", action="store_true", effect_needs=MOE_MODEL, help=_TE_KERNEL),
    ),
    group("training", ROUTING_REPLAY),
)


def build(ns: argparse.Namespace, machine: Machine) -> MoEConfig:
    """The MoE knobs; the GPU-only ones checked against this machine (a warning, or for flex an error)."""
    if MOE_MODEL.holds(ns):
        te = machine.has_module("transformer_engine")
        for name, given in (
            ("--moe-grouped-gemm", ns.moe_grouped_gemm),
            ("--moe-permute-fusion", ns.moe_permute_fusion),
        ):
            machine.expect(
                not given or te,
                f"{name} is Transformer Engine's GPU kernel, absent here: each expert runs its own matmul and "
                f"tokens are permuted by torch ops (the same function)",
            )
        machine.require(
            ns.moe_token_dispatcher_type != "flex" or machine.has_module("deep_ep"),
            "--moe-token-dispatcher-type flex needs DeepEP (GPUs); alltoall or allgather run anywhere",
        )
    return MoEConfig(
        router_dtype=ns.moe_router_dtype,
        aux_loss_coeff=ns.moe_aux_loss_coeff,
        load_balancing_type=ns.moe_router_load_balancing_type,
        token_dispatcher_type=ns.moe_token_dispatcher_type,
        expert_capacity_factor=ns.moe_expert_capacity_factor,
        token_drop_policy=ns.moe_token_drop_policy,
        grouped_gemm=ns.moe_grouped_gemm,
        permute_fusion=ns.moe_permute_fusion,
        bias_update_rate=ns.moe_router_bias_update_rate,
    )
