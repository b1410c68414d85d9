"""config.json -> the Megatron-LM flags that describe the same model: one row per flag, pure and unit-tested for the
llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, glm4_moe and deepseek_v3 families
(``config/model.py`` checks a launcher's flags against it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Families whose layout is known: which have q/k norms, and which put a bias on q/k/v only.
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")
QK_NORM = ("qwen3", "qwen3_moe")
QKV_BIAS = ("qwen2", "qwen2_moe")
# Families whose attention_bias biases q/k/v only (Llama's also biases o_proj).
QKV_ONLY_ATTENTION_BIAS = QKV_BIAS + ("glm4_moe",)
# Sigmoid routers that choose by score plus a learned per-expert bias and scale the chosen weights (GLM-4.5,
# DeepSeek-V3), with shared experts.
EXPERT_BIAS = ("glm4_moe", "deepseek_v3")
# Multi-latent attention: DeepSeek-V3 (and Kimi-K2, its architecture), DeepSeek-V3.2 and GLM-5 (with DSA's
# indexer on top), GLM-4.7-Flash. Their heads are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim; Miles'
# launchers give --kv-channels as the query/key head (qk_nope_head_dim) or the value head, never config.json's
# head_dim (the RoPE part), and Megatron-LM's MLA does not read it.
MLA = ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa", "glm4_moe_lite")


# -- config.json -> Megatron-LM flags (pure) ------------------------------------------------------
def _rope(hf: Mapping[str, Any]) -> dict:
    """RoPE settings from either config.json (rope_theta + rope_scaling) or transformers 5 (rope_parameters)."""
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        rope = {**hf["rope_scaling"], **rope}
    if "rope_theta" not in rope and hf.get("rope_theta") is not None:
        rope["rope_theta"] = hf["rope_theta"]
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _num_experts(hf: Mapping[str, Any]) -> int | None:
    return hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or None


def _moe_layers(hf: Mapping[str, Any]) -> list[int] | None:
    """Which layers are MoE (1) or dense (0), as --moe-layer-freq lists them: Qwen's decoder_sparse_step and
    mlp_only_layers, GLM's and DeepSeek's first_k_dense_replace."""
    if _num_experts(hf) is None:
        return None
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    dense |= set(range(hf.get("first_k_dense_replace") or 0))
    return [0 if i in dense or (i + 1) % step else 1 for i in range(hf["num_hidden_layers"])]


def _shared_expert(hf: Mapping[str, Any]) -> int | None:
    """The shared expert's hidden size: Qwen2-MoE's own, GLM's and DeepSeek's n_shared_experts routed-expert
    sizes."""
    if hf.get("model_type") in EXPERT_BIAS:
        return (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"] or None
    return hf.get("shared_expert_intermediate_size") or None


def _qk_norm(hf: Mapping[str, Any]) -> bool:
    # Under multi-latent attention, Megatron-LM's --qk-layernorm is the norm of each low-rank latent.
    mt = hf["model_type"]
    return mt in QK_NORM + MLA or (mt == "glm4_moe" and bool(hf.get("use_qk_norm")))


def _mla(hf: Mapping[str, Any]) -> bool:
    # a kv_lora_rank is MLA's latent whatever the family is named
    return hf.get("model_type") in MLA or hf.get("kv_lora_rank") is not None


def _not_mla(hf: Mapping[str, Any]) -> bool:
    return not _mla(hf)


def uses_yarn(hf: Mapping[str, Any]) -> bool:
    return _mla(hf) and _rope(hf)["rope_type"] == "yarn"


def _groups(hf: Mapping[str, Any]) -> int | None:
    """DeepSeek's expert groups (n_group), None without group-limited routing."""
    return hf.get("n_group") if (hf.get("n_group") or 1) > 1 else None


def _expert_bias(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") in EXPERT_BIAS


def _known(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") in DENSE + MOE


def _is_moe(hf: Mapping[str, Any]) -> bool:
    return _num_experts(hf) is not None


def _llama3_rope(hf: Mapping[str, Any]) -> bool:
    return _rope(hf)["rope_type"] == "llama3"


def _always(hf: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """One Megatron-LM flag: the config.json keys it is read from, its value, and for which configs it applies."""

    flag: str
    keys: tuple[str, ...]
    value: Callable[[Mapping[str, Any]], Any]
    applies: Callable[[Mapping[str, Any]], bool] = _always


def _bias_linear(hf: Mapping[str, Any]) -> bool:
    # Llama's attention_bias also biases o_proj, which Megatron ties to the MLP's add_bias_linear; Qwen2's
    # q/k/v biases are --add-qkv-bias alone.
    o_proj_bias = bool(hf.get("attention_bias")) and hf["model_type"] not in QKV_ONLY_ATTENTION_BIAS
    return not (o_proj_bias or hf.get("mlp_bias", False))


TABLE: tuple[Row, ...] = (
    Row("--num-layers", ("num_hidden_layers",), lambda hf: hf["num_hidden_layers"]),
    Row("--hidden-size", ("hidden_size",), lambda hf: hf["hidden_size"]),
    Row("--ffn-hidden-size", ("intermediate_size",), lambda hf: hf["intermediate_size"]),
    Row("--num-attention-heads", ("num_attention_heads",), lambda hf: hf["num_attention_heads"]),
    Row(
        "--num-query-groups",
        ("num_key_value_heads",),
        lambda hf: hf.get("num_key_value_heads") or hf["num_attention_heads"],
    ),
    Row(
        "--kv-channels",
        ("head_dim",),
        lambda hf: hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        _not_mla,  # multi-latent attention's heads are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim
    ),
    Row("--swiglu", ("hidden_act",), lambda hf: hf.get("hidden_act", "silu") == "silu"),
    Row("--normalization", ("model_type",), lambda hf: "RMSNorm", _known),
    Row("--norm-epsilon", ("rms_norm_eps",), lambda hf: hf.get("rms_norm_eps")),
    Row("--position-embedding-type", ("model_type",), lambda hf: "rope", _known),
    Row("--rotary-base", ("rope_theta",), lambda hf: float(_rope(hf).get("rope_theta", 10000.0))),
    Row(
        "--rotary-percent",
        ("partial_rotary_factor",),
        lambda hf: _rope(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0,
    ),
    Row("--use-rope-scaling", ("rope_type",), _llama3_rope),
    Row("--rope-scaling-factor", ("rope_type", "factor"), lambda hf: float(_rope(hf)["factor"]), _llama3_rope),
    Row("--max-position-embeddings", ("max_position_embeddings",), lambda hf: hf.get("max_position_embeddings")),
    Row("--vocab-size", ("vocab_size",), lambda hf: hf["vocab_size"]),
    Row(
        "--untie-embeddings-and-output-weights",
        ("tie_word_embeddings",),
        lambda hf: not hf.get("tie_word_embeddings", False),
    ),
    Row("--qk-layernorm", ("model_type", "use_qk_norm"), _qk_norm, _known),
    Row("--multi-latent-attention", ("model_type",), _mla, _known),
    Row("--q-lora-rank", ("q_lora_rank",), lambda hf: hf.get("q_lora_rank"), _mla),
    Row("--kv-lora-rank", ("kv_lora_rank",), lambda hf: hf["kv_lora_rank"], _mla),
    Row("--qk-head-dim", ("qk_nope_head_dim",), lambda hf: hf["qk_nope_head_dim"], _mla),
    Row("--qk-pos-emb-head-dim", ("qk_rope_head_dim",), lambda hf: hf["qk_rope_head_dim"], _mla),
    Row("--v-head-dim", ("v_head_dim",), lambda hf: hf["v_head_dim"], _mla),
    Row("--rotary-scaling-factor", ("rope_type", "factor"), lambda hf: float(_rope(hf)["factor"]), uses_yarn),
    Row("--mscale", ("rope_type", "mscale"), lambda hf: float(_rope(hf).get("mscale", 1.0)), uses_yarn),
    Row(
        "--mscale-all-dim",
        ("rope_type", "mscale_all_dim"),
        lambda hf: float(_rope(hf).get("mscale_all_dim", 0.0)),
        uses_yarn,
    ),
    Row(
        "--add-qkv-bias",
        ("model_type", "attention_bias"),
        lambda hf: hf["model_type"] in QKV_BIAS or bool(hf.get("attention_bias")),
        _known,
    ),
    Row("--disable-bias-linear", ("attention_bias", "mlp_bias"), _bias_linear, _known),
    Row("--num-experts", ("num_experts",), _num_experts),
    Row("--moe-router-topk", ("num_experts_per_tok",), lambda hf: hf.get("num_experts_per_tok"), _is_moe),
    Row(
        "--moe-ffn-hidden-size",
        ("moe_intermediate_size",),
        lambda hf: hf.get("moe_intermediate_size") or hf["intermediate_size"],
        _is_moe,
    ),
    Row("--moe-layer-freq", ("decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace"), _moe_layers, _is_moe),
    Row(
        "--moe-shared-expert-intermediate-size",
        ("shared_expert_intermediate_size", "n_shared_experts", "moe_intermediate_size"),
        _shared_expert,
        lambda hf: _is_moe(hf) and _shared_expert(hf) is not None,
    ),
    Row(
        "--moe-router-score-function",
        ("model_type",),
        lambda hf: "sigmoid" if _expert_bias(hf) else "softmax",
        lambda hf: _is_moe(hf) and _known(hf),
    ),
    Row("--moe-router-enable-expert-bias", ("model_type",), _expert_bias, lambda hf: _is_moe(hf) and _known(hf)),
    Row(
        "--moe-router-topk-scaling-factor",
        ("routed_scaling_factor",),
        lambda hf: float(hf.get("routed_scaling_factor") or 1.0),
        _expert_bias,
    ),
    Row("--moe-router-num-groups", ("n_group",), _groups, _expert_bias),
    Row(
        "--moe-router-group-topk",
        ("topk_group",),
        lambda hf: hf.get("topk_group") if _groups(hf) else None,
        _expert_bias,
    ),
)
ROWS = {row.flag: row for row in TABLE}


def text_model(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the model the Megatron-LM flags describe. A multimodal config.json (Qwen3-VL, Qwen3.5 and
    3.6, Kimi-K2.5) nests its language model under ``text_config``, whose keys then win over the wrapper's; a
    hybrid Mamba config (Nemotron-H) counts its layers in ``layers_block_type`` (``hybrid_override_pattern`` as
    written), one letter or name per layer, as Megatron-LM's --num-layers does; its MLP's activation is
    ``mlp_hidden_act`` (squared ReLU, no SwiGLU), and it has experts only where a layer is MoE (``E``, ``moe``),
    whatever expert counts transformers fills in."""
    out = dict(hf)
    text = hf.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in hf:
        out = {**{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}, **text}
    pattern = out.get("layers_block_type") or out.get("hybrid_override_pattern")
    if pattern:
        out.setdefault("num_hidden_layers", len(pattern))
        out.setdefault("hidden_act", out.get("mlp_hidden_act"))
        if not any(kind in ("E", "moe") for kind in pattern):
            for key in ("num_experts", "num_local_experts", "n_routed_experts"):
                out.pop(key, None)
    return out


def read_rows(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each row's value from ``text_model(hf)``, and for each row that reads a key the config lacks, that key
    (the row is then not compared)."""
    text = text_model(hf)
    values, missing = {}, {}
    for row in TABLE:
        try:
            if row.applies(text):
                values[row.flag] = row.value(text)
        except KeyError as e:
            missing[row.flag] = str(e.args[0])
    return values, missing


def megatron_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Megatron-LM flags (by name; switches True/False) that build the model config.json describes. A flag
    whose value the config does not determine (an unknown family's norms or biases, a dense model's MoE flags, a
    key the config lacks) is left out; --num-experts is None for a dense model."""
    values, _ = read_rows(hf)
    return {k: v for k, v in values.items() if v is not None or k == "--num-experts"}


def config_source(hf: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The config.json keys a row reads, with their values, for messages."""
    hf = text_model(hf)
    rope = _rope(hf)
    special = {
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope["rope_type"],
        "factor": rope.get("factor"),
        "num_experts": _num_experts(hf),
    }
    return ", ".join(f"{k} {special[k] if k in special else hf.get(k)}" for k in keys)
