"""Training (the policy's and the critic's trainers, their optimizer and batch split): flags, checks and the
typed ``TrainConfig`` and ``OptimizerConfig``."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from miles_async.config.algorithm import CRITIC, AlgorithmConfig
from miles_async.config.capabilities import resolve_weight_update_method
from miles_async.config.cluster import num_train_workers
from miles_async.config.declare import (
    Fallback,
    When,
    at_least,
    each,
    flag,
    given,
    group,
    hf_folder,
    hf_or_torch_dist,
    importable,
    positive,
    regex,
    require,
    when_value,
    within,
)
from miles_async.config.megatron import MegatronConfig
from miles_async.config.moe import is_moe
from miles_async.utils.cpus import cpu_list


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str  # "adam" (AdamW: decoupled weight decay, as Megatron's) or "sgd"
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    sgd_momentum: float = 0.9
    lr_decay_iters: int | None = None  # optimizer steps the decay spans; None: the whole run


@dataclass(frozen=True)
class LoraSettings:
    """--lora-*: adapters on the torch backend's policy (backends/fsdp/lora.py)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]  # module name suffixes, or ("all-linear",)
    save_adapter: bool = False  # --save-hf also writes the adapter alone into <save-hf>/adapter


@dataclass(frozen=True)
class TrainConfig:
    backend: str
    model_path: str  # HF folder of the policy: its config, tokenizer and (without init_weights) its weights
    ref_model_path: str | None
    dtype: str
    global_batch_size: int  # samples per optimizer step
    num_steps_per_rollout: int
    max_tokens_per_gpu: int
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    update_weight_buffer_size: int
    gradient_checkpointing: bool
    seed: int
    num_threads: int
    role: str = "actor"  # "actor" or "critic": also the checkpoint sub-folder
    max_kept_weight_versions: int = 2  # --keep-old-actor: weight versions still in flight
    megatron: MegatronConfig = MegatronConfig()
    attention_dropout: float = 0.0  # dropout in training passes only; log-probs are computed without it
    hidden_dropout: float = 0.0  # megatron only: the HF models of the torch backend have no hidden dropout
    shared_prefix: bool = False  # the policy's passes compute each group's prompt once (backends/shared_prefix.py)
    cpu_offload: bool = False  # sharded torch backend: shards, gradients and optimizer state in host memory
    lora: LoraSettings | None = None  # the policy trains LoRA adapters only (torch backend)
    freeze_vision_tower: bool = False  # a VLM policy trains its language model only
    # --only-train-params-name-list / --freeze-params-name-list: regexes selecting the weights that train
    only_train_params: tuple[str, ...] = ()
    freeze_params: tuple[str, ...] = ()
    cpu_affinity: tuple[int, ...] | None = None  # --train-cpu-affinity: the cores each worker is pinned to
    routing_replay: bool = False  # --use-rollout-routing-replay: policy passes route tokens as the rollout did
    # A fresh run's weights when not model_path's: --ref-load's (HF or torch_dist) under an empty --load, or
    # --load's Megatron-LM release checkpoint (config/checkpoint.py start_from)
    init_weights: str | None = None


SHARED_PREFIX = flag(
    "--shared-prefix",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="the policy's training, old and reference log-prob passes compute a group's prompt once: its samples "
    "become one sequence, prompt then every response, each response attending to the prompt and to itself "
    "only; --max-tokens-per-gpu counts the prompt once. Same log-probs and gradients as one row per sample up "
    "to float rounding. torch backend with sdpa or eager attention; the critic keeps one row per sample. "
    "--no-shared-prefix: one row per sample",
)
LORA = When("--lora-rank > 0", lambda ns: ns.lora_rank > 0)


def _module_list(name: str, value: str) -> str | None:
    if not [m for m in value.split(",") if m.strip()]:
        return f"{name} names no module: give comma-separated module names (q_proj,v_proj) or all-linear"
    return None


ADAM = when_value("--optimizer", "adam")
SGD = when_value("--optimizer", "sgd")

GROUPS = (
    group(
        "cluster",
        flag(
            "--train-num-threads",
            type=int,
            default=None,
            check=at_least(1),
            help="torch threads per training worker (default: half the cores; all of them under --synchronous, where "
            "generation and training take turns; the number of --train-cpu-affinity cores when that is given)",
        ),
        flag(
            "--train-cpu-affinity",
            type=cpu_list,
            default=None,
            metavar="CORES",
            help="pin each training worker to these CPU cores (e.g. 0 or 0-3,8, as taskset -c), and with "
            "--rollout-cpu-affinity the engines to others: the machine split between training and generation as a "
            "GPU cluster splits its GPUs",
        ),
    ),
    group(
        "model and checkpoints",
        flag(
            "--hf-checkpoint",
            required=False,
            default=None,
            check=(given(" (an HF model folder)"), hf_folder),
            help="HF model folder the policy starts from (its config.json and tokenizer always; its weights unless "
            "an empty --load starts the policy from --ref-load)",
        ),
        flag(
            "--ref-load",
            default=None,
            check=hf_or_torch_dist,
            help="the reference model for the KL loss: an HF folder, or a Megatron-LM torch_dist checkpoint "
            "(its tracker naming iter_NNNNNNN/ or release/, as Miles' convert_hf_to_torch_dist.py writes; "
            "--train-backend megatron). Under an empty --load the policy starts from it too, as in Miles",
        ),
    ),
    group(
        "inference engines",
        flag(
            "--update-weight-buffer-size",
            type=int,
            default=512 * 1024**2,
            check=positive(),
            effect_needs=When(
                "--weight-update-method tensor or distributed", lambda ns: resolve_weight_update_method(ns) != "disk"
            ),
            help="bytes per weight bucket",
        ),
    ),
    group(
        "training",
        flag(
            "--train-backend",
            default=Fallback("fsdp"),
            choices=("fsdp", "megatron"),
            check=importable("megatron.core", "megatron-core: pip install -r requirements-megatron.txt", "megatron"),
            help="fsdp: HF transformers models, sharded by FSDP2 over 2 or more workers (each transformer block and "
            "the root; the reference model and the critic as well); megatron: Megatron-core GPTModel "
            "(pip install -r requirements-megatron.txt). Not given: megatron when the command gives a Megatron-LM "
            "parallel layout flag (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
            "--context-parallel-size or --expert-model-parallel-size above 1, --sequence-parallel, "
            "--use-distributed-optimizer), as Miles' launchers do (Miles' trainer is Megatron), else fsdp; the choice "
            "is logged",
        ),
        flag("--bf16", action="store_true", help="bf16 mixed precision: autocast matmuls, fp32 weights and optimizer"),
        flag("--global-batch-size", type=int, default=None, check=at_least(1), help="samples per optimizer step"),
        flag(
            "--num-steps-per-rollout",
            help="optimizer steps per rollout (it must divide rollout-batch-size x n-samples-per-prompt); or give "
            "--global-batch-size",
            type=int,
            default=None,
            check=at_least(1),
        ),
        flag(
            "--max-tokens-per-gpu",
            type=int,
            default=8192,
            check=at_least(1),
            help="token budget of one micro-batch: samples are packed in order while (longest sample x samples) "
            "fits, a longer sample gets a micro-batch of its own",
        ),
        flag(
            "--use-dynamic-batch-size",
            action="store_true",
            ignored="micro-batches are always packed to --max-tokens-per-gpu tokens (Miles' dynamic batch size, "
            "counting padded tokens), with or without it",
        ),
        SHARED_PREFIX,
        flag(
            "--fsdp-cpu-offload",
            action="store_true",
            effect_needs=When(
                "--train-backend fsdp with 2 or more training workers (one worker is not sharded)",
                lambda ns: ns.train_backend == "fsdp" and num_train_workers(ns) > 1,
            ),
            help="FSDP2's CPU offload: parameter shards, gradients and optimizer state live in host memory and "
            "each block's weights move to the GPU for its compute (slower; fits a larger model)",
        ),
        flag(
            "--gradient-checkpointing",
            action="store_true",
            help="recompute activations in backward: HF gradient checkpointing (fsdp); Megatron's full recompute "
            "of every layer (megatron), as --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1",
        ),
        flag(
            "--attention-dropout",
            type=float,
            default=0.0,
            check=within(0, 1),
            help="RL trains without dropout (the engines sample without it; Megatron-LM's default is 0.1). "
            "Applied in training passes on both backends",
        ),
        flag(
            "--hidden-dropout",
            type=float,
            default=0.0,
            check=within(0, 1),
            effect_needs=when_value(
                "--train-backend", "megatron", why="the HF models of the torch backend have no hidden dropout"
            ),
            help="as --attention-dropout, for Megatron's residual dropout",
        ),
        flag(
            "--freeze-vision-tower",
            action="store_true",
            help="a vision-language policy trains its language model only; its vision encoder and projector keep "
            "the checkpoint's weights",
        ),
        flag(
            "--only-train-params-name-list",
            nargs="+",
            default=None,
            check=each(regex),
            help="regexes (re.search) on the policy's parameter names: only the weights matching one train, the rest "
            "keep the checkpoint's (slime's flag; e.g. 'visual' trains a VLM's vision tower only). Not with "
            "--lora-rank",
        ),
        flag(
            "--freeze-params-name-list",
            nargs="+",
            default=None,
            check=each(regex),
            help="regexes (re.search) on the policy's parameter names: the weights matching one keep the "
            "checkpoint's (slime's flag; applied after --only-train-params-name-list). Not with --lora-rank",
        ),
        flag(
            "--seed",
            help="seed of the training workers' random state (each rank adds its rank)",
            type=int,
            default=1234,
        ),
    ),
    group(
        "LoRA (torch backend)",
        flag(
            "--lora-rank",
            type=int,
            default=0,
            check=at_least(0, " (0: no LoRA)"),
            help="train LoRA adapters of this rank on the policy's linear layers instead of its weights (peft); "
            "the optimizer and checkpoints hold only the adapters, the engines get merged weights",
        ),
        flag(
            "--lora-alpha", type=float, default=16.0, check=positive(), effect_needs=LORA, help="LoRA scaling numerator"
        ),
        flag(
            "--lora-dropout",
            type=float,
            default=0.0,
            check=within(0, 1),
            effect_needs=LORA,
            help="dropout on the adapters' input in training passes (0 keeps the first step's importance ratio 1)",
        ),
        flag(
            "--lora-target-modules",
            default="all-linear",
            check=_module_list,
            effect_needs=LORA,
            help="comma-separated module names to adapt (q_proj,k_proj,v_proj,o_proj), or all-linear: every linear "
            "layer but the output head",
        ),
        flag(
            "--save-lora-adapter",
            action="store_true",
            needs=LORA,
            effect_needs=When("--save-hf", lambda ns: ns.save_hf is not None),
            help="--save-hf also writes the adapter alone, as a PEFT folder, into <save-hf>/adapter",
        ),
    ),
    group(
        "critic (--advantage-estimator ppo)",
        flag(
            "--critic-load",
            default=None,
            check=hf_folder,
            needs=CRITIC,
            help="HF folder the critic starts from (default: --hf-checkpoint; its value head starts random)",
        ),
        flag("--critic-lr", type=float, default=None, check=positive(), needs=CRITIC, help="default: --lr"),
        flag(
            "--critic-lr-warmup-iters",
            type=int,
            default=None,
            check=at_least(0),
            needs=CRITIC,
            help="default: --lr-warmup-iters",
        ),
    ),
    group(
        "optimizer",
        flag(
            "--optimizer",
            default="adam",
            choices=("adam", "sgd"),
            help="adam: AdamW (decoupled weight decay, as Megatron's); sgd: SGD with --sgd-momentum, weight "
            "decay as L2",
        ),
        flag(
            "--sgd-momentum",
            help="momentum of --optimizer sgd",
            type=float,
            default=0.9,
            check=within(0, 1),
            effect_needs=SGD,
        ),
        flag("--lr", help="peak learning rate", type=float, default=1e-6, check=positive()),
        flag(
            "--min-lr",
            help="the learning rate the decay ends at",
            type=float,
            default=0.0,
            check=at_least(0),
            effect_needs=when_value("--lr-decay-style", "linear", "cosine"),
        ),
        flag(
            "--lr-warmup-iters",
            help="optimizer steps of linear warm-up from 0 to --lr",
            type=int,
            default=0,
            check=at_least(0),
        ),
        flag(
            "--lr-decay-style",
            help="learning-rate schedule after warm-up: constant, or linear / cosine down to --min-lr",
            default="constant",
            choices=("constant", "linear", "cosine"),
        ),
        flag(
            "--lr-decay-iters",
            type=int,
            default=None,
            check=at_least(1),
            effect_needs=when_value("--lr-decay-style", "linear", "cosine"),
            help="optimizer steps the decay spans, warm-up included (Megatron's); then --min-lr holds. "
            "Default: the whole run. A fixed span keeps a shorter run on the same schedule as a longer one",
        ),
        flag("--weight-decay", help="AdamW's decoupled weight decay", type=float, default=0.0),
        flag(
            "--adam-beta1",
            help="Adam's first-moment decay",
            type=float,
            default=0.9,
            check=within(0, 1),
            effect_needs=ADAM,
        ),
        flag(
            "--adam-beta2",
            help="Adam's second-moment decay",
            type=float,
            default=0.98,
            check=within(0, 1),
            effect_needs=ADAM,
        ),
        flag("--adam-eps", help="Adam's epsilon", type=float, default=1e-8, check=positive(), effect_needs=ADAM),
        flag(
            "--clip-grad",
            help="clip the gradients' global norm to this (0: no clipping)",
            type=float,
            default=1.0,
            check=at_least(0, " (0 disables clipping)"),
        ),
    ),
)


def batch_split(ns: argparse.Namespace) -> tuple[int, int]:
    """(samples per optimizer step, optimizer steps per rollout) from --global-batch-size or
    --num-steps-per-rollout; one step over the whole rollout when neither is given."""
    samples = ns.rollout_batch_size * ns.n_samples_per_prompt
    if ns.global_batch_size is None and ns.num_steps_per_rollout is None:
        return samples, 1
    if ns.global_batch_size is None:
        steps = ns.num_steps_per_rollout
        require(
            samples % steps == 0,
            f"--num-steps-per-rollout {steps} must divide rollout-batch-size * n-samples-per-prompt = {samples}",
        )
        return samples // steps, steps
    batch = ns.global_batch_size
    require(
        batch <= samples,
        f"--global-batch-size {batch} is larger than one rollout "
        f"(--rollout-batch-size * --n-samples-per-prompt = {samples})",
    )
    require(
        samples % batch == 0,
        f"--global-batch-size {batch} must divide rollout-batch-size * n-samples-per-prompt = {samples}",
    )
    steps = samples // batch
    require(
        ns.num_steps_per_rollout in (None, steps),
        f"--num-steps-per-rollout {ns.num_steps_per_rollout} "
        f"contradicts --global-batch-size {batch} (which gives {steps})",
    )
    return batch, steps


def check_data_parallel(global_batch: int, data_parallel: int, num_critic_workers: int) -> None:
    require(
        global_batch % data_parallel == 0,
        f"the global batch ({global_batch} samples) must split evenly over "
        f"{data_parallel} data-parallel training workers",
    )
    require(
        num_critic_workers == 0 or global_batch % num_critic_workers == 0,
        f"the global batch ({global_batch} samples) must split evenly over {num_critic_workers} critic workers",
    )


def build(
    ns: argparse.Namespace,
    algorithm: AlgorithmConfig,
    megatron: MegatronConfig,
    global_batch: int,
    num_steps: int,
    num_threads: int,
    init_weights: str | None = None,
) -> TrainConfig:
    require(
        ns.lora_rank == 0 or not (ns.only_train_params_name_list or ns.freeze_params_name_list),
        "--only-train-params-name-list / --freeze-params-name-list with --lora-rank: LoRA already decides which "
        "weights train (the adapters); drop one",
    )
    optimizer = OptimizerConfig(
        ns.optimizer,
        ns.lr,
        ns.min_lr,
        ns.lr_warmup_iters,
        ns.lr_decay_style,
        ns.weight_decay,
        ns.adam_beta1,
        ns.adam_beta2,
        ns.adam_eps,
        ns.clip_grad,
        ns.sgd_momentum,
        ns.lr_decay_iters,
    )
    return TrainConfig(
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
        gradient_checkpointing=ns.gradient_checkpointing or ns.recompute_granularity is not None,
        seed=ns.seed,
        num_threads=ns.train_num_threads or len(ns.train_cpu_affinity or ()) or num_threads,
        cpu_affinity=ns.train_cpu_affinity,
        max_kept_weight_versions=(ns.max_staleness_steps if ns.fully_async else 1) + 2,
        megatron=megatron,
        attention_dropout=ns.attention_dropout,
        hidden_dropout=ns.hidden_dropout,
        shared_prefix=ns.shared_prefix and ns.train_backend == "fsdp",
        cpu_offload=ns.fsdp_cpu_offload,
        lora=LoraSettings(
            ns.lora_rank,
            ns.lora_alpha,
            ns.lora_dropout,
            tuple(m.strip() for m in ns.lora_target_modules.split(",") if m.strip()),
            ns.save_lora_adapter,
        )
        if ns.lora_rank > 0
        else None,
        freeze_vision_tower=ns.freeze_vision_tower,
        only_train_params=tuple(ns.only_train_params_name_list or ()),
        freeze_params=tuple(ns.freeze_params_name_list or ()),
        routing_replay=ns.use_rollout_routing_replay and is_moe(ns),
        init_weights=init_weights,
    )


def build_critic(ns: argparse.Namespace, actor: TrainConfig) -> TrainConfig | None:
    """The critic's trainer (--advantage-estimator ppo): the actor's, with the critic's model and optimizer."""
    if not actor.algorithm.uses_critic:
        return None
    lr = ns.critic_lr or ns.lr
    warmup = ns.lr_warmup_iters if ns.critic_lr_warmup_iters is None else ns.critic_lr_warmup_iters
    return dataclasses.replace(
        actor,
        role="critic",
        model_path=ns.critic_load or ns.hf_checkpoint,
        ref_model_path=None,
        init_weights=None,  # the value model starts from --critic-load or --hf-checkpoint
        lora=None,  # the value model trains whole
        only_train_params=(),  # the policy's selection names the policy's weights; the value head is not among them
        freeze_params=(),
        routing_replay=False,  # the value model's routing is its own: the rollout never ran it
        optimizer=dataclasses.replace(actor.optimizer, lr=lr, min_lr=min(ns.min_lr, lr), lr_warmup_iters=warmup),
    )
