"""Megatron-core's parallel layout and its training knobs (--train-backend megatron): flags, checks against the
model and the workers, and the typed ``MegatronConfig``. Which features the megatron backend lacks is in the
capability table (``capabilities.py``).

Activation recompute (--recompute-granularity/method/num-layers) is Megatron's own; on the torch backend
--recompute-granularity switches on HF gradient checkpointing of every layer (``train.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import miles_async.config.moe as moe
from miles_async.config.declare import When, at_least, flag, group, require, when_value
from miles_async.config.hf_to_megatron import text_model
from miles_async.config.machine import Machine


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-core's parallel layout (--train-backend megatron); data parallel = workers / (TP * PP * CP). The
    experts of MoE layers split over EP x ETP ranks carved out of TP x DP (their data parallelism: the rest)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = None  # "full" | "selective": Megatron's activation recompute
    recompute_method: str | None = None  # "uniform" | "block" (full only)
    recompute_num_layers: int | None = None
    attention_backend: str = "auto"  # Megatron's AttnBackend: which of Transformer Engine's attentions runs
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: TP's size (Megatron-LM's default)
    moe: moe.MoEConfig = moe.MoEConfig()
    decoder_first_pipeline_num_layers: int | None = None  # uneven stages; None: an even split
    decoder_last_pipeline_num_layers: int | None = None
    # The optimizer's memory (megatron-core's OptimizerConfig): its state and step on the CPU (all of it, or a
    # fraction), the copies overlapped with the step, and Transformer Engine's precision-aware FusedAdam.
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


MEGATRON = when_value("--train-backend", "megatron")
FULL_RECOMPUTE = When(
    "--train-backend megatron --recompute-granularity full",
    lambda ns: ns.train_backend == "megatron" and ns.recompute_granularity == "full",
)


PIPELINE = When("--pipeline-model-parallel-size > 1", lambda ns: ns.pipeline_model_parallel_size > 1)
OFFLOAD = When(
    "--train-backend megatron --optimizer-cpu-offload",
    lambda ns: ns.train_backend == "megatron" and ns.optimizer_cpu_offload,
)

GROUPS = (
    group(
        "megatron (--train-backend megatron)",
        flag(
            "--tensor-model-parallel-size",
            help="tensor-parallel size of the megatron backend",
            type=int,
            default=1,
            check=at_least(1),
        ),
        flag(
            "--pipeline-model-parallel-size",
            type=int,
            default=1,
            check=at_least(1),
            help="split the layers over this many stages, run through megatron-core's 1F1B schedule",
        ),
        *(
            flag(
                f"--decoder-{end}-pipeline-num-layers",
                type=int,
                default=None,
                check=at_least(1),
                effect_needs=PIPELINE,
                help=f"layers of the {end} pipeline stage (uneven stages); the other stages split the rest evenly",
            )
            for end in ("first", "last")
        ),
        flag(
            "--num-layers-per-virtual-pipeline-stage",
            type=int,
            default=None,
            check=at_least(1),
            help="refused: the interleaved (virtual pipeline) schedule is not run by the megatron backend",
        ),
        flag(
            "--context-parallel-size",
            type=int,
            default=1,
            check=at_least(1),
            help="context parallelism: each sequence split over this many ranks in 2 x CP chunks, as Megatron splits "
            "it (needs Transformer Engine's attention)",
        ),
        flag(
            "--sequence-parallel",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="split the sequence over the tensor-parallel ranks outside attention and the MLP; MoE layers under "
            "TP need it. At --tensor-model-parallel-size 1 it is turned off with a warning, as Megatron-LM does; "
            "--no-sequence-parallel turns off a launcher's --sequence-parallel",
        ),
        flag(
            "--use-distributed-optimizer",
            action="store_true",
            help="shard the optimizer state over the data-parallel ranks",
        ),
        flag(
            "--optimizer-cpu-offload",
            action="store_true",
            effect_needs=MEGATRON,
            help="keep the optimizer's state and run its step on the CPU (megatron-core's HybridDeviceOptimizer), "
            "freeing GPU memory; with the distributed optimizer",
        ),
        flag(
            "--optimizer-offload-fraction",
            type=float,
            default=1.0,
            check=at_least(0.0),
            effect_needs=OFFLOAD,
            help="the share of the optimizer's state kept on the CPU (Megatron-LM's default: all of it)",
        ),
        flag(
            "--overlap-cpu-optimizer-d2h-h2d",
            action="store_true",
            effect_needs=OFFLOAD,
            help="overlap the CPU optimizer's step with the copies of gradients to it and of weights back",
        ),
        flag(
            "--use-precision-aware-optimizer",
            action="store_true",
            effect_needs=MEGATRON,
            help="Transformer Engine's FusedAdam with its master weights and state in their own dtypes; with the "
            "distributed optimizer",
        ),
        flag(
            "--expert-model-parallel-size",
            type=int,
            default=1,
            check=at_least(1),
            help="split each MoE layer's experts over this many ranks (out of data parallelism)",
        ),
        flag(
            "--expert-tensor-parallel-size",
            type=int,
            default=None,
            check=at_least(1),
            # slime's dense launchers pass 1 (no expert tensor parallelism), which says nothing there.
            effect_needs=When(moe.MOE_MODEL.text, lambda ns: ns.expert_tensor_parallel_size == 1 or moe.is_moe(ns)),
            help="tensor parallelism inside each expert; default: --tensor-model-parallel-size, as in Megatron-LM",
        ),
        flag(
            "--recompute-method",
            default=None,
            choices=("uniform", "block"),
            effect_needs=FULL_RECOMPUTE,
            help="full recompute: checkpoint --recompute-num-layers layers per chunk (uniform) or the first "
            "--recompute-num-layers layers (block)",
        ),
        flag(
            "--recompute-num-layers",
            help="layers per recomputed chunk (with --recompute-granularity full)",
            type=int,
            default=None,
            check=at_least(1),
            effect_needs=FULL_RECOMPUTE,
        ),
        flag(
            "--attention-backend",
            default="auto",
            choices=("flash", "fused", "unfused", "local", "auto"),
            effect_needs=MEGATRON,
            help="Transformer Engine's attention implementation (sets NVTE_FLASH_ATTN/NVTE_FUSED_ATTN/"
            "NVTE_UNFUSED_ATTN); without Transformer Engine Megatron's local attention runs",
        ),
        flag(
            "--attention-softmax-in-fp32",
            action="store_true",
            effect_needs=MEGATRON,
            help="always on with --train-backend megatron (megatron-core's default); the torch backend's "
            "attention is transformers'",
        ),
        flag(
            "--accumulate-allreduce-grads-in-fp32",
            action="store_true",
            help="always on: both backends accumulate and all-reduce gradients in fp32 (Megatron's "
            "grad_reduce_in_fp32; the torch backend keeps fp32 parameters and gradients)",
        ),
    ),
    group(
        "training",
        flag(
            "--recompute-granularity",
            default=None,
            choices=("full", "selective"),
            help="activation recompute. megatron: Megatron's own (full needs --recompute-method and "
            "--recompute-num-layers; selective recomputes core attention); fsdp: HF gradient checkpointing "
            "of every layer, for either value",
        ),
    ),
)


def sequence_parallel_without_tp(ns: argparse.Namespace) -> list[str]:
    """Megatron-LM's own adjustment: --sequence-parallel at TP 1 has no ranks to split over, so it is turned off
    (on ``ns``) with a warning, where Miles' single-GPU-per-model launchers pass it."""
    if not (ns.sequence_parallel and ns.tensor_model_parallel_size == 1):
        return []
    ns.sequence_parallel = False
    return [
        "--sequence-parallel is turned off: --tensor-model-parallel-size is 1, and sequence parallelism splits "
        "sequences over the tensor-parallel ranks (Megatron-LM turns it off the same way)"
    ]


def validate(ns: argparse.Namespace) -> None:
    require(
        ns.num_layers_per_virtual_pipeline_stage is None,
        f"--num-layers-per-virtual-pipeline-stage {ns.num_layers_per_virtual_pipeline_stage}: the interleaved "
        "(virtual pipeline) schedule is not supported by the megatron backend (each rank builds one model chunk); "
        "drop it to run the 1F1B schedule over --pipeline-model-parallel-size stages",
    )
    full_recompute = ns.recompute_granularity == "full" or (ns.gradient_checkpointing and not ns.recompute_granularity)
    require(
        not (
            ns.train_backend == "megatron"
            and ns.use_rollout_routing_replay
            and ns.pipeline_model_parallel_size > 1
            and full_recompute
        ),
        "--use-rollout-routing-replay with --pipeline-model-parallel-size > 1 and full activation recompute: the 1F1B "
        "schedule recomputes a micro-batch's layers after later micro-batches' forwards, and the replay routes each "
        "pass by the latest micro-batch's record; drop the recompute (--recompute-granularity selective keeps the "
        "routers out of it) or the pipeline",
    )
    if ns.train_backend != "megatron" or ns.recompute_granularity is None:
        return
    if ns.recompute_granularity == "selective":
        require(
            ns.recompute_method is None and ns.recompute_num_layers is None,
            "--recompute-granularity selective recomputes core attention in every layer: drop "
            "--recompute-method and --recompute-num-layers (they choose layers for full recompute)",
        )
    else:
        require(
            ns.recompute_method is not None and ns.recompute_num_layers is not None,
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers, as in Megatron-LM (e.g. uniform 1: every layer)",
        )


def build(ns: argparse.Namespace, num_workers: int, machine: Machine) -> MegatronConfig:
    """The layout, checked against the workers and the model (--train-backend fsdp refuses these flags in the
    capability table, so there it is the default)."""
    granularity = ns.recompute_granularity
    if ns.gradient_checkpointing and granularity is None:
        granularity, method, layers = "full", "uniform", 1  # every layer, as HF gradient checkpointing does
    else:
        method, layers = ns.recompute_method, ns.recompute_num_layers
    mcfg = MegatronConfig(
        ns.tensor_model_parallel_size,
        ns.pipeline_model_parallel_size,
        ns.context_parallel_size,
        ns.sequence_parallel,
        ns.use_distributed_optimizer,
        granularity,
        method,
        layers,
        ns.attention_backend,
        ns.expert_model_parallel_size,
        ns.expert_tensor_parallel_size,
        moe.build(ns, machine),
        ns.decoder_first_pipeline_num_layers,
        ns.decoder_last_pipeline_num_layers,
        ns.optimizer_cpu_offload,
        ns.optimizer_offload_fraction,
        ns.overlap_cpu_optimizer_d2h_h2d,
        ns.use_precision_aware_optimizer,
    )
    if ns.train_backend != "megatron":
        return mcfg
    te = machine.has_module("transformer_engine")
    mcfg = _optimizer_memory(mcfg, machine, te)
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    # The data path splits each sequence over the CP ranks (backends/megatron/context_parallel.py); the attention
    # that exchanges keys and values between them is Transformer Engine's.
    machine.require(
        cp == 1 or te,
        f"--context-parallel-size {cp} needs Transformer Engine: megatron-core's context-parallel attention is "
        "Transformer Engine's (transformer_engine is not installed here)",
    )
    # megatron-core 0.16.1's local spec splits multi-latent attention's down projections over TP and gathers their
    # output; the RoPE key part of that output then gets back only its own TP rank's heads' gradient (a step at TP 2
    # differed from the unparallel one in exactly those rows). Transformer Engine's spec keeps them whole.
    machine.require(
        tp == 1 or te or not _is_mla(ns),
        f"--tensor-model-parallel-size {tp} with multi-latent attention (DeepSeek-V3) needs Transformer Engine's "
        "layers: without them megatron-core 0.16.1 loses part of the RoPE key's gradient under TP (use expert "
        "parallelism and data parallelism instead; transformer_engine is not installed here)",
    )
    require(
        num_workers % mcfg.model_parallel_size == 0,
        f"{num_workers} training workers do not split into TP {tp} x PP {pp} x CP {cp} model-parallel groups",
    )
    machine.expect(
        ns.attention_backend == "auto" or te,
        f"--attention-backend {ns.attention_backend} chooses among Transformer Engine's attentions; "
        f"without Transformer Engine Megatron's local attention runs",
    )
    config = json.loads((Path(ns.hf_checkpoint) / "config.json").read_text())
    require(
        "vision_config" not in config,
        f"--train-backend megatron: {ns.hf_checkpoint} is a vision-language model (model_type "
        f"{config.get('model_type')!r}, a vision_config in its config.json) and the megatron backend builds no "
        "vision tower: --train-backend fsdp trains it",
    )
    config = text_model(config)  # the layers and heads as the model flags read them (Nemotron-H counts its pattern)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    require(
        heads % tp == 0 and kv_heads % tp == 0,
        f"--tensor-model-parallel-size {tp} must divide the model's {heads} attention heads and "
        f"{kv_heads} key/value heads",
    )
    _check_experts(ns, mcfg, config, num_workers)
    num_layers = config.get("num_hidden_layers")
    if num_layers is not None:
        _check_stages(mcfg, num_layers, f"{ns.hf_checkpoint}/config.json")
    require(
        layers is None or num_layers is None or layers <= num_layers,
        f"--recompute-num-layers {layers} is more than the model's {num_layers} layers",
    )
    return mcfg


def _is_mla(ns: argparse.Namespace) -> bool:
    from miles_async.config.hf_to_megatron import MLA
    from miles_async.config.model import hf_config_json

    return hf_config_json(ns).get("model_type") in MLA


def _optimizer_memory(mcfg: MegatronConfig, machine: Machine, te: bool) -> MegatronConfig:
    """Miles' optimizer-memory flags: megatron-core runs them with the distributed optimizer only, which Miles turns
    on for every run, so a Miles launcher that gives them without --use-distributed-optimizer gets it (said in a
    warning). What this machine lacks for them is said too: they take effect where the actors have GPUs (and
    Transformer Engine)."""
    switches = {
        "--optimizer-cpu-offload": mcfg.optimizer_cpu_offload,
        "--use-precision-aware-optimizer": mcfg.use_precision_aware_optimizer,
    }
    given = [name for name, on in switches.items() if on]
    if given and not mcfg.use_distributed_optimizer:
        machine.expect(
            False,
            f"{' and '.join(given)} run with the distributed optimizer only (megatron-core's): "
            "--use-distributed-optimizer is turned on, as Miles does for every run",
        )
        mcfg = dataclasses.replace(mcfg, use_distributed_optimizer=True)
    machine.expect(
        not mcfg.optimizer_cpu_offload or machine.cuda_devices() > 0,
        "--optimizer-cpu-offload moves the optimizer's state and step from the GPU to the CPU; without a GPU here "
        "they are on the CPU already (it takes effect on GPU nodes)",
    )
    machine.expect(
        not mcfg.use_precision_aware_optimizer or te,
        "--use-precision-aware-optimizer is Transformer Engine's FusedAdam, absent here: the optimizer keeps fp32 "
        "master weights and fp32 state",
    )
    return mcfg


def _check_stages(mcfg: MegatronConfig, num_layers: int, where: str) -> None:
    """The model's layers split over the pipeline stages: at least one each, the middle ones evenly."""
    pp = mcfg.pipeline_model_parallel_size
    if pp == 1:
        return
    ends = {"first": mcfg.decoder_first_pipeline_num_layers, "last": mcfg.decoder_last_pipeline_num_layers}
    rest, stages = num_layers - sum(n or 0 for n in ends.values()), pp - sum(n is not None for n in ends.values())
    given = " ".join(f"--decoder-{end}-pipeline-num-layers {n}" for end, n in ends.items() if n is not None)
    split = f"--pipeline-model-parallel-size {pp}{' ' + given if given else ''}"
    require(
        rest >= stages and (rest % stages == 0 if stages else rest == 0),
        f"{split} does not split the {num_layers} layers of {where}: {rest} are left for {stages} stages, which "
        f"take an equal number each, at least one (--decoder-first-pipeline-num-layers and "
        f"--decoder-last-pipeline-num-layers set the first and last stages' own)",
    )


def _check_experts(ns: argparse.Namespace, mcfg: MegatronConfig, config: dict, num_workers: int) -> None:
    """The MoE family is one the backend builds, and its experts split over the expert-parallel layout."""
    where = f"{ns.hf_checkpoint}/config.json"
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    ep, tp = mcfg.expert_model_parallel_size, mcfg.tensor_model_parallel_size
    if not experts:
        require(
            ep == 1,
            f"--expert-model-parallel-size {ep} splits the experts of MoE layers; {where} describes a dense model "
            f"(model_type {config.get('model_type')})",
        )
        return
    require(config.get("model_type") in moe.BUILT, f"{moe.not_built(config.get('model_type'))} ({where})")
    etp = mcfg.expert_tensor_parallel_size or tp
    dp = num_workers // mcfg.model_parallel_size
    require(
        (tp * mcfg.context_parallel_size * dp) % (ep * etp) == 0,
        f"--expert-model-parallel-size {ep} x expert tensor parallelism {etp} must divide TP {tp} x CP "
        f"{mcfg.context_parallel_size} x data parallel {dp} (the expert ranks come out of those)",
    )
    require(experts % ep == 0, f"--expert-model-parallel-size {ep} must divide the {experts} experts of {where}")
    pp = mcfg.pipeline_model_parallel_size
    layout = " ".join(f"--{flag}-model-parallel-size {n}" for flag, n in (("expert", ep), ("pipeline", pp)) if n > 1)
    require(
        not layout or ns.moe_token_dispatcher_type != "allgather",
        f"{layout} needs --moe-token-dispatcher-type alltoall (Miles' MoE launchers pass it): the allgather "
        f"dispatcher gathers equal-sized blocks of tokens, and micro-batches are packed by tokens here (Miles' "
        f"--use-dynamic-batch-size), so their sizes differ between ranks and between micro-batches",
    )
    ffn = config.get("moe_intermediate_size") or config.get("intermediate_size") or etp
    require(
        ffn % etp == 0,
        f"expert tensor parallelism {etp} (--expert-tensor-parallel-size, default TP) must divide the experts' "
        f"hidden size {ffn} ({where})",
    )
    require(
        tp == 1 or mcfg.sequence_parallel,
        f"--tensor-model-parallel-size {tp} on an MoE model needs --sequence-parallel: megatron-core refuses to "
        f"train MoE layers under tensor parallelism without it (as Miles' MoE launchers pass it)",
    )
