"""Typed, validated configuration handed to each component.

``arguments.parse_args`` builds these once from the command line; components receive
only the piece they need, never the argparse namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


@dataclass(frozen=True)
class ClusterConfig:
    ray_address: str | None
    num_train_workers: int
    train_num_threads: int
    rollout_num_threads: int
    use_gpu: bool
    num_critic_workers: int = 0


@dataclass(frozen=True)
class FaultToleranceConfig:
    """--use-fault-tolerance: engines are health-checked, quarantined, restarted and re-seeded with the weights."""
    health_check_interval: float  # seconds between two rounds of health checks
    health_check_timeout: float  # seconds one health check may take
    max_engine_restarts: int  # restarts per engine over the run before it is given up
    failure_threshold: int = 2  # failed checks in a row that quarantine an engine whose process still runs
    restart_backoff_base: float = 1.0
    restart_backoff_cap: float = 60.0


@dataclass(frozen=True)
class EngineConfig:
    backend: str  # "embedded", "sglang" or "vllm"
    model_path: str
    num_engines: int
    dtype: str
    max_running_requests: int
    num_threads: int
    host: str
    startup_timeout: float
    request_timeout: float
    seed: int
    debug_step_seconds: float = 0.0  # benchmarks: a fixed cost added to every decode step
    fault_tolerance: FaultToleranceConfig | None = None  # None: a dead engine fails the run
    check_weight_update_equal: bool = False  # compare engine and trainer weight checksums after each update
    router: str = "builtin"  # "builtin" or "sglang" (SGLang's own router, untested here)
    # --rollout-backend sglang / vllm: the python of the engine's environment, --sglang-* / --vllm-* flags
    # passed through to its server (e.g. ("--mem-fraction-static", "0.7")), GPUs per engine (its tensor
    # parallel size), whether the engines get GPUs (else the engine's CPU build), and the folder the disk
    # weight route writes to.
    sglang_python: str | None = None
    sglang_args: tuple[str, ...] = ()
    vllm_python: str | None = None
    vllm_args: tuple[str, ...] = ()
    num_gpus_per_engine: int = 1
    use_gpu: bool = False
    weight_update_dir: str | None = None
    weight_update_method: str = "tensor"  # "tensor", "disk" or "distributed" (--weight-update-method, resolved)


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
class FullyAsyncConfig:
    max_staleness_steps: int
    max_concurrent_groups: int
    zero_variance_filter: bool
    zero_variance_tol: float
    watchdog_seconds: float


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
    timeout: float = 1800.0
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False


@dataclass(frozen=True)
class EvalConfig:
    datasets: tuple[tuple[str, str], ...]  # (name, path)
    interval: int | None
    n_samples_per_prompt: int
    sampling: SamplingConfig
    skip_before_train: bool
    max_in_flight: int
    input_key: str
    label_key: str


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


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-core's parallel layout (--train-backend megatron); data parallel = workers / (TP * PP * CP)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class TrainConfig:
    backend: str
    model_path: str  # HF folder the policy starts from
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
    debug_train_seconds: float | None = None  # benchmarks: replace training by a sleep of this length
    role: str = "actor"  # "actor" or "critic": also the checkpoint sub-folder
    max_kept_weight_versions: int = 2  # --keep-old-actor: weight versions still in flight
    megatron: MegatronConfig = MegatronConfig()


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    save_hf: str | None
    save_trigger_sentinel: str | None
    no_save_optim: bool


@dataclass(frozen=True)
class TrackingConfig:
    output_dir: str
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    wandb_run_name: str | None
    use_tensorboard: bool
    tensorboard_dir: str | None
    plot: bool


@dataclass(frozen=True)
class LoopConfig:
    num_rollout: int
    num_rollout_per_epoch: int
    start_rollout_id: int
    update_weights_interval: int
    eval_interval: int | None
    save_interval: int | None
    debug_exit_after_rollout: int | None
    rollout_timeout: float
    fully_async: bool = False
    pause_generation_mode: str = "in_place"
    num_critic_only_steps: int = 0
    synchronous: bool = False  # generate each rollout only after the previous step's weights are in


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    engine: EngineConfig
    rollout: RolloutConfig
    eval: EvalConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig
    loop: LoopConfig
    critic: TrainConfig | None = None
