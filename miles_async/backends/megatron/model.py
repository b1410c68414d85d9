"""A Megatron-core ``GPTModel`` built from an HF config (Llama, Qwen2, Qwen3 and look-alikes).

``ArchSpec`` reads what the conversion and the model need from an HF ``config.json``
(RMSNorm, SwiGLU, RoPE with the model's theta, grouped-query attention, tied or untied
embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms) and refuses what it cannot map.
The layer spec is Transformer Engine's when ``transformer_engine`` imports, otherwise
Megatron's local one; the conversion names follow whichever was used.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from miles_async.config import TrainConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, else None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, config) -> ArchSpec:
        mt = config.model_type
        if mt not in SUPPORTED:
            raise ValueError(f"--train-backend megatron: model_type {mt!r} is not supported (supported: {SUPPORTED})")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"--train-backend megatron: hidden_act {act!r} (only SwiGLU/silu is mapped)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("--train-backend megatron: mlp_bias=True is not mapped")
        attention_bias = getattr(config, "attention_bias", False)
        if attention_bias and mt != "qwen2":
            # Llama's attention_bias also biases o_proj, which Megatron ties to the MLP's add_bias_linear.
            raise ValueError("--train-backend megatron: attention_bias=True on a llama-style model is not mapped")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        legacy = getattr(config, "rope_scaling", None)
        if legacy and not rope.get("rope_type"):
            rope.update(legacy)
            rope_type = legacy.get("rope_type", legacy.get("type", "default"))
        factor = None
        if rope_type == "llama3":
            if (
                rope.get("low_freq_factor", 1.0),
                rope.get("high_freq_factor", 4.0),
                rope.get("original_max_position_embeddings", 8192),
            ) != (1.0, 4.0, 8192):
                raise ValueError(
                    f"--train-backend megatron: llama3 RoPE scaling {rope} differs from Megatron's "
                    "fixed low/high factors 1/4 and original length 8192"
                )
            factor = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"--train-backend megatron: RoPE type {rope_type!r} is not mapped")
        heads = config.num_attention_heads
        return cls(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling_factor=factor,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(attention_bias),
            qk_norm=mt == "qwen3",
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def have_transformer_engine() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install falls back to the local spec
        return False
    return True


def layer_spec(arch: ArchSpec, use_te: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")


def training_knobs(cfg: TrainConfig) -> dict[str, Any]:
    """The TransformerConfig fields the training flags set: activation recompute (--recompute-*), dropout
    (--attention-dropout, --hidden-dropout) and Transformer Engine's attention (--attention-backend)."""
    from megatron.core.transformer.enums import AttnBackend

    m = cfg.megatron
    return {
        "recompute_granularity": m.recompute_granularity,
        "recompute_method": m.recompute_method,
        "recompute_num_layers": m.recompute_num_layers,
        "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout,
        "attention_backend": AttnBackend[m.attention_backend],
    }


def transformer_config(
    arch: ArchSpec, par: ParallelSizes, bf16: bool, use_cpu_init: bool, knobs: Mapping[str, Any] | None = None
):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        sequence_parallel=par.sequence_parallel,
        # --bf16 is Megatron's mixed precision: bf16 weights and compute, fp32 master weights in the optimizer.
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_cpu_initialization=use_cpu_init,
        # Every weight is overwritten from the HF checkpoint, but initialisation must stay on: only that
        # path marks the TP-sharded weights (tensor_model_parallel), which the grad norm relies on.
        perform_initialization=True,
        **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **(knobs or {})},
    )


def build_gpt_model(arch: ArchSpec, par: ParallelSizes, bf16: bool = False, knobs: Mapping[str, Any] | None = None):
    """The model of this rank (pre/post-process by pipeline stage), on the current device; ``knobs``: the
    training flags' TransformerConfig fields (``training_knobs``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    use_te = have_transformer_engine()
    cfg = transformer_config(arch, par, bf16, use_cpu_init=not torch.cuda.is_available(), knobs=knobs)
    # Megatron's autograd functions are custom_fwd(device_type="cuda"); torch autocast is not used here.
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(arch, use_te),
        vocab_size=arch.padded_vocab(par.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        parallel_output=False,  # full-vocabulary logits on every TP rank; log-probs need the whole softmax
    )
    model.use_te = use_te
    return model


def init_parallel(
    rank: int,
    world_size: int,
    par: ParallelSizes,
    master_addr: str,
    master_port: int,
    seed: int,
    hosted: TCPStore | None = None,
) -> None:
    """torch.distributed (NCCL on GPUs, gloo on the CPU), joined through the rendezvous at ``master_addr:master_port``
    (``hosted`` when this process serves it: ``join_process_group``), and Megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from miles_async.backends.megatron import cpu_compat
    from miles_async.backends.worker import join_process_group

    cpu_compat.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(torch.cuda.current_device())
        join_process_group(backend, rank, world_size, master_addr, master_port, hosted)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, context_parallel_size=par.cp
        )
    model_parallel_cuda_manual_seed(seed)
