"""A Megatron-core ``GPTModel`` built from an HF config (Llama, Qwen2, Qwen3 and look-alikes, and the MoE
families Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and DeepSeek-V3).

``ArchSpec`` reads what the conversion and the model need from an HF ``config.json``
(RMSNorm, SwiGLU, RoPE with the model's theta, grouped-query attention, tied or untied
embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms; for MoE models ``MoESpec``: experts, top-k,
where the router's softmax sits or GLM's sigmoid router with its expert bias and scale, which layers are MoE,
the shared expert and its gate; GLM's partial RoPE; DeepSeek-V3's multi-latent attention, ``MLASpec``, and its
group-limited routing) and refuses
what it cannot map. The layer spec is Transformer Engine's when ``transformer_engine`` imports,
otherwise Megatron's local one; the conversion names follow whichever was used.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from miles_async.config.hf_to_megatron import QKV_ONLY_ATTENTION_BIAS
from miles_async.config.moe import not_built

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from miles_async.backends.megatron.bridge import Names
    from miles_async.config import TrainConfig
    from miles_async.config.megatron import MegatronConfig

DENSE = ("llama", "qwen2", "qwen3", "mistral")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
# The families whose router is a sigmoid choosing by score plus an expert bias, with shared experts and dense first
# layers, named alike in HF (mlp.gate.e_score_correction_bias, mlp.shared_experts).
SIGMOID_ROUTER = ("glm4_moe", "deepseek_v3")
SUPPORTED = DENSE + MOE


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    ep: int = 1  # expert parallelism: the experts of each MoE layer split over EP ranks (carved out of DP)
    etp: int | None = None  # expert tensor parallelism; None: TP's size, as in Megatron-LM
    # Uneven pipeline stages: the first's and the last's layers (None: an even split of what the others leave).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass(frozen=True)
class MoESpec:
    """An HF MoE block as Megatron's ``MoELayer`` builds it."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # of each routed expert
    layer_freq: tuple[int, ...]  # per layer: 1 MoE, 0 dense (Megatron's moe_layer_freq as a list)
    # Qwen's norm_topk_prob false: top-k of the softmax over all experts (Megatron's moe_router_pre_softmax);
    # true, and Mixtral: the top-k probabilities renormalised, which is the softmax over the top-k logits.
    pre_softmax: bool
    shared_ffn_hidden_size: int | None = None  # Qwen2-MoE's and GLM's shared expert
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on it
    # GLM-4.5: sigmoid scores; the top-k chosen by score plus a per-expert bias (a buffer the checkpoint holds),
    # weighted by the scores renormalised over the top-k and scaled by routed_scaling_factor.
    score_function: str = "softmax"
    expert_bias: bool = False
    topk_scaling_factor: float | None = None
    # DeepSeek-V3's group-limited routing: the experts in num_groups groups, each token choosing among the
    # group_topk groups whose best two scores sum highest (None: no groups).
    num_groups: int | None = None
    group_topk: int | None = None

    @classmethod
    def from_hf(cls, config) -> MoESpec:
        mt = config.model_type
        if mt == "mixtral":
            if getattr(config, "router_jitter_noise", 0.0):
                raise ValueError(
                    "--train-backend megatron: Mixtral's router_jitter_noise scales the experts' input too, "
                    "Megatron's moe_input_jitter_eps only the router's: not mapped"
                )
            n = config.num_local_experts
            return cls(n, config.num_experts_per_tok, config.intermediate_size, (1,) * config.num_hidden_layers, False)
        if mt in SIGMOID_ROUTER:
            return cls._sigmoid_router(config)
        step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", ()) or ())
        freq = tuple(0 if i in dense or (i + 1) % step else 1 for i in range(config.num_hidden_layers))
        shared = getattr(config, "shared_expert_intermediate_size", None) if mt == "qwen2_moe" else None
        return cls(
            num_experts=config.num_experts,
            topk=config.num_experts_per_tok,
            ffn_hidden_size=config.moe_intermediate_size,
            layer_freq=freq,
            pre_softmax=not getattr(config, "norm_topk_prob", False),
            shared_ffn_hidden_size=shared or None,
            shared_gate=bool(shared),
        )

    @classmethod
    def _sigmoid_router(cls, config) -> MoESpec:
        """GLM-4.5's and DeepSeek-V3's MoE block."""
        k = config.num_experts_per_tok
        groups, group_topk = getattr(config, "n_group", 1) or 1, getattr(config, "topk_group", 1) or 1
        if groups > 1 and k != 2 * group_topk:
            # HF ranks a group by its best two scores; Megatron by its best topk / group_topk.
            raise ValueError(
                f"--train-backend megatron: group-limited top-k with num_experts_per_tok {k} and topk_group "
                f"{group_topk} is not mapped: transformers ranks each group by its 2 best experts, megatron-core by "
                f"its num_experts_per_tok / topk_group = {k / group_topk:g} best (DeepSeek-V3's 8 / 4 agree)"
            )
        if k > 1 and not getattr(config, "norm_topk_prob", True):
            # Megatron renormalises a sigmoid router's top-k weights whenever k > 1.
            raise ValueError("--train-backend megatron: a sigmoid router with norm_topk_prob false is not mapped")
        dense = getattr(config, "first_k_dense_replace", 0) or 0
        shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        return cls(
            num_experts=config.n_routed_experts,
            topk=k,
            ffn_hidden_size=config.moe_intermediate_size,
            layer_freq=tuple(0 if i < dense else 1 for i in range(config.num_hidden_layers)),
            pre_softmax=False,
            shared_ffn_hidden_size=shared or None,
            score_function="sigmoid",
            expert_bias=True,
            topk_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            num_groups=groups if groups > 1 else None,
            group_topk=group_topk if groups > 1 else None,
        )


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek-V3's multi-latent attention as megatron-core's ``MLASelfAttention`` builds it: queries through a
    low-rank projection (``q_lora_rank``; None: a plain one), keys and values from one shared latent of
    ``kv_lora_rank`` plus a RoPE part of ``qk_rope_head_dim`` per token, each with its RMSNorm; RoPE on the
    interleaved pairs of each head's last ``qk_rope_head_dim`` (both transformers, with ``rope_interleave``, and
    megatron-core de-interleave them first), plain or YaRN-scaled."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: tuple[tuple[str, float], ...] | None  # MLATransformerConfig's YaRN fields, None: plain RoPE

    @classmethod
    def from_hf(cls, config) -> MLASpec:
        if not getattr(config, "rope_interleave", True):
            raise ValueError(
                "--train-backend megatron: rope_interleave false is not mapped (megatron-core's multi-latent "
                "attention always rotates the interleaved pairs)"
            )
        rope = {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}
        kind = rope.get("rope_type", rope.get("type", "default"))
        yarn = None
        if kind == "yarn":
            yarn = (
                ("rotary_scaling_factor", float(rope["factor"])),
                ("original_max_position_embeddings", float(rope.get("original_max_position_embeddings", 4096))),
                ("beta_fast", float(rope.get("beta_fast", 32))),
                ("beta_slow", float(rope.get("beta_slow", 1))),
                ("mscale", float(rope.get("mscale", 1.0))),
                ("mscale_all_dim", float(rope.get("mscale_all_dim", 0.0))),
            )
        elif kind != "default":
            raise ValueError(f"--train-backend megatron: RoPE type {kind!r} with multi-latent attention is not mapped")
        return cls(
            q_lora_rank=getattr(config, "q_lora_rank", None) or None,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            yarn=yarn,
        )

    def fields(self) -> dict[str, Any]:
        """MLATransformerConfig's fields."""
        out: dict[str, Any] = {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_head_dim": self.qk_nope_head_dim,
            "qk_pos_emb_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rotary_base": self.rope_theta,
            "rope_type": "yarn" if self.yarn else "rope",
            # The latent norms (q_layernorm, kv_layernorm) exist only with qk_layernorm.
            "qk_layernorm": True,
        }
        if self.yarn:
            out.update(dict(self.yarn))
            out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
        return out


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
    moe: MoESpec | None = None
    rotary_percent: float = 1.0  # GLM's partial_rotary_factor: RoPE on the first part of each head only
    mla: MLASpec | None = None  # DeepSeek-V3's multi-latent attention
    hf_config: Any = field(default=None, compare=False, repr=False)  # the transformers config it was read from

    @cached_property
    def names(self) -> Names:
        """HF names and fused layouts of this model's parameters (mbridge's tables: ``bridge.py``)."""
        from miles_async.backends.megatron.bridge import Names

        return Names(self.hf_config)

    @classmethod
    def from_hf(cls, config) -> ArchSpec:
        mt = config.model_type
        if mt not in SUPPORTED and _experts(config):
            raise ValueError(not_built(mt))
        if mt not in SUPPORTED:
            raise ValueError(f"--train-backend megatron: model_type {mt!r} is not supported (supported: {SUPPORTED})")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"--train-backend megatron: hidden_act {act!r} (only SwiGLU/silu is mapped)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("--train-backend megatron: mlp_bias=True is not mapped")
        attention_bias = getattr(config, "attention_bias", False)
        if attention_bias and mt not in QKV_ONLY_ATTENTION_BIAS:
            # Llama's attention_bias also biases o_proj, which Megatron ties to the MLP's add_bias_linear.
            raise ValueError("--train-backend megatron: attention_bias=True on a llama-style model is not mapped")
        mla = MLASpec.from_hf(config) if mt == "deepseek_v3" else None
        rope = dict(getattr(config, "rope_parameters", None) or {}) if mla is None else {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        legacy = getattr(config, "rope_scaling", None) if mla is None else None  # MLA's RoPE: MLASpec
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
            qkv_bias=mt == "qwen2" or (mt == "qwen2_moe" and getattr(config, "qkv_bias", True)) or bool(attention_bias),
            qk_norm=mt in ("qwen3", "qwen3_moe") or (mt == "glm4_moe" and bool(getattr(config, "use_qk_norm", False))),
            moe=MoESpec.from_hf(config) if mt in MOE else None,
            mla=mla,
            rotary_percent=float(
                rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
            ),
            hf_config=config,
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def _experts(config) -> int | None:
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return next((n for n in (getattr(config, k, None) for k in keys) if n), None)


def have_transformer_engine() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install falls back to the local spec
        return False
    return True


class LocalRMSNorm:
    """torch's RMSNorm, as Megatron's local spec builds it (``WrappedTorchNorm``), that also runs under sequence
    parallelism: each TP rank then normalises its own share of the tokens, so the weight's gradient is a partial
    sum, which the ``sequence_parallel`` mark has Megatron's ``finalize_model_grads`` all-reduce over TP (what
    Transformer Engine's norms mark). MoE layers need it: Megatron refuses to train them under TP without
    sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class LocalMLACoreAttention(torch.nn.Module):
    """Causal attention for multi-latent attention without Transformer Engine: megatron-core 0.16.1's local
    ``DotProductAttention`` takes no ``k_channels``/``v_channels``, which MLA gives it (its keys are wider than its
    values), so its local spec does not build. torch's ``scaled_dot_product_attention`` with MLA's softmax scale;
    the micro-batches are laid out so that a causal mask is the only mask (``actor.megatron_layout``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.config, self.softmax_scale = config, softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (THD) in the local multi-latent attention")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        dropout = self.config.attention_dropout if self.training else 0.0
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=dropout
        )
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [s, b, h * d_v]


def _swap_modules(spec, swaps: Mapping[type, type]):
    """``spec`` (a layer's or block's) with every module class in ``swaps`` replaced by its value, however deep."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type) and spec in swaps:
        return swaps[spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec, module=_swap_modules(spec.module, swaps), submodules=_swap_modules(spec.submodules, swaps)
        )
    if isinstance(spec, list):
        return [_swap_modules(s, swaps) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec, **{f.name: _swap_modules(getattr(spec, f.name), swaps) for f in dataclasses.fields(spec) if f.init}
        )
    return spec


def _local_modules(spec, mla: bool):
    """The local spec with ``LocalRMSNorm`` for every torch norm and, for multi-latent attention,
    ``LocalMLACoreAttention`` for the local ``DotProductAttention``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    swaps: dict[type, type] = {WrappedTorchNorm: LocalRMSNorm}
    if mla:
        swaps[DotProductAttention] = LocalMLACoreAttention
    return _swap_modules(spec, swaps)


def layer_spec(arch: ArchSpec, use_te: bool, config):
    """The decoder block's spec for ``config`` (MoE and dense layers by ``moe_layer_freq``); Transformer
    Engine's layers, or the local spec's with ``LocalRMSNorm``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if arch.moe is not None:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    elif use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        layer = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        # As a block, so that the final norm is ours too (given one layer, Megatron picks it itself).
        spec = TransformerBlockSubmodules([layer] * get_num_layers_to_build(config), layer_norm=LocalRMSNorm)
    return spec if use_te else _local_modules(spec, arch.mla is not None)


def training_knobs(cfg: TrainConfig) -> dict[str, Any]:
    """The TransformerConfig fields the training flags set: activation recompute (--recompute-*), dropout
    (--attention-dropout, --hidden-dropout), Transformer Engine's attention (--attention-backend) and the MoE
    layers' router, load balancing and token dispatch (--moe-*; only an MoE model reads them). Grouped GEMM and
    the fused permutation are Transformer Engine's kernels: without it (on the CPU) they stay off, as the
    parse-time warning says."""
    from megatron.core.transformer.enums import AttnBackend

    m = cfg.megatron
    te = have_transformer_engine()
    return {
        "recompute_granularity": m.recompute_granularity,
        "recompute_method": m.recompute_method,
        "recompute_num_layers": m.recompute_num_layers,
        "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout,
        "attention_backend": AttnBackend[m.attention_backend],
        "moe_router_dtype": m.moe.router_dtype,
        "moe_aux_loss_coeff": m.moe.aux_loss_coeff,
        "moe_router_load_balancing_type": m.moe.load_balancing_type,
        "moe_token_dispatcher_type": m.moe.token_dispatcher_type,
        "moe_expert_capacity_factor": m.moe.expert_capacity_factor,
        "moe_token_drop_policy": m.moe.token_drop_policy,
        "moe_grouped_gemm": m.moe.grouped_gemm and te,
        "moe_permute_fusion": m.moe.permute_fusion and te,
        "moe_router_bias_update_rate": m.moe.bias_update_rate,
        # --use-rollout-routing-replay: each router holds megatron-core's RouterReplay (backends/routing_replay.py)
        "moe_enable_routing_replay": cfg.routing_replay,
    }


def optimizer_memory(m: MegatronConfig, cuda: bool, te: bool) -> dict[str, Any]:
    """The OptimizerConfig fields of the optimizer-memory flags, for a rank with (``cuda``) or without a GPU and
    with (``te``) or without Transformer Engine: CPU offload means nothing where everything is on the CPU, and the
    precision-aware optimizer is Transformer Engine's FusedAdam (the parse-time warnings say both)."""
    offload = m.optimizer_cpu_offload and cuda
    return {
        "optimizer_cpu_offload": offload,
        "optimizer_offload_fraction": m.optimizer_offload_fraction if offload else 0.0,
        "overlap_cpu_optimizer_d2h_h2d": offload and m.overlap_cpu_optimizer_d2h_h2d,
        "use_precision_aware_optimizer": m.use_precision_aware_optimizer and cuda and te,
    }


def moe_fields(arch: ArchSpec) -> dict[str, Any]:
    """The TransformerConfig fields config.json sets for an MoE model (none for a dense one)."""
    m = arch.moe
    if m is None:
        return {}
    return {
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.topk,
        "moe_ffn_hidden_size": m.ffn_hidden_size,
        "moe_layer_freq": list(m.layer_freq),
        "moe_router_pre_softmax": m.pre_softmax,
        "moe_router_score_function": m.score_function,
        "moe_router_enable_expert_bias": m.expert_bias,
        "moe_router_topk_scaling_factor": m.topk_scaling_factor,
        "moe_shared_expert_intermediate_size": m.shared_ffn_hidden_size,
        "moe_shared_expert_gate": m.shared_gate,
        "moe_router_num_groups": m.num_groups,
        "moe_router_group_topk": m.group_topk,
    }


def transformer_config(
    arch: ArchSpec, par: ParallelSizes, bf16: bool, use_cpu_init: bool, knobs: Mapping[str, Any] | None = None
):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    # A dense model keeps Megatron's MoE defaults whatever the --moe-* flags say (they warn there).
    knobs = {k: v for k, v in (knobs or {}).items() if arch.moe is not None or not k.startswith("moe_")}
    if arch.moe is None and par.pp > 1:
        # megatron-core refuses its default allgather dispatcher with variable_seq_lengths, even with no MoE layer.
        knobs["moe_token_dispatcher_type"] = "alltoall"
    config_class, attention = TransformerConfig, {"qk_layernorm": arch.qk_norm}
    if arch.mla is not None:
        config_class, attention = MLATransformerConfig, arch.mla.fields()
    return config_class(
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
        **attention,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        num_layers_in_first_pipeline_stage=par.first_stage_layers if par.pp > 1 else None,
        num_layers_in_last_pipeline_stage=par.last_stage_layers if par.pp > 1 else None,
        # What the stages exchange: the activations in the parameters' dtype, of each micro-batch's own shape
        # (micro-batches are packed by tokens, so their lengths differ) sent ahead of it.
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        variable_seq_lengths=par.pp > 1,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        # --bf16 is Megatron's mixed precision: bf16 weights and compute, fp32 master weights in the optimizer.
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_cpu_initialization=use_cpu_init,
        # Every weight is overwritten from the HF checkpoint, but initialisation must stay on: only that
        # path marks the TP-sharded weights (tensor_model_parallel), which the grad norm relies on.
        perform_initialization=True,
        **moe_fields(arch),
        **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **knobs},
    )


def build_gpt_model(arch: ArchSpec, par: ParallelSizes, bf16: bool = False, knobs: Mapping[str, Any] | None = None):
    """The model of this rank (pre/post-process by pipeline stage), on the current device; ``knobs``: the
    training flags' TransformerConfig fields (``training_knobs``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    use_te = have_transformer_engine()
    if not use_te:
        _without_te()
    cfg = transformer_config(arch, par, bf16, use_cpu_init=not torch.cuda.is_available(), knobs=knobs)
    # Megatron's autograd functions are custom_fwd(device_type="cuda"); torch autocast is not used here.
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(arch, use_te, cfg),
        vocab_size=arch.padded_vocab(par.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        parallel_output=False,  # full-vocabulary logits on every TP rank; log-probs need the whole softmax
    )
    model.use_te = use_te
    return model


def _without_te() -> None:
    """Two places where megatron-core 0.16.1 believes in a Transformer Engine that is not installed (the local
    spec, any device): its router matmul tests ``te_general_gemm is not None``, a name its module defines only when
    Transformer Engine imports, so define it as absent and the router takes its torch matmul; and its multi-latent
    attention, whose module imports the MagicMock stand-ins megatron-core makes for Transformer Engine's layers and
    so sets ``HAVE_TE``, then fails on ``isinstance(linear_proj, <a MagicMock>)``, so say it is absent. Both are
    registered in ``utils/upstream_patches.py``."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from miles_async.utils.upstream_patches import check

    check("megatron.core.transformer.moe.moe_utils.te_general_gemm", "main")
    check("megatron.core.transformer.multi_latent_attention.HAVE_TE", "main")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False


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
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            context_parallel_size=par.cp,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.etp,
        )
    model_parallel_cuda_manual_seed(seed)
