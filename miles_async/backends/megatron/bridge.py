"""Megatron <-> HF names and fused layouts from mbridge (slime's bridge), for the model this backend builds.

mbridge keeps, per model family, which HF tensors each Megatron-core parameter is made of (its ``_DIRECT_MAPPING``,
``_ATTENTION_MAPPING`` and ``_MLP_MAPPING``: dense, MoE, GLM-4.5's and DeepSeek-V3's multi-latent attention and
expert bias) and how they fuse (``_weight_to_mcore_format``: q/k/v interleaved by key/value group, ``[gate; up]``;
``_weight_to_hf_format`` the other way). Those are what this module uses. Not its model build: it hard-codes
Transformer Engine's layer spec, and its loader and exporter run through its own parallel state. So:

- the model is ours (``model.py``, megatron-core's local spec on a CPU), and its parameter names are the local
  spec's, where mbridge's tables name the Transformer Engine spec's: ``te_name`` spells a local name as mbridge
  expects it (a layer norm fused into the projection after it; a routed expert as the grouped GEMM's
  ``linear_fc1.weight<expert>``), with the global layer and expert numbers;
- each tensor-parallel, expert-parallel and pipeline shard is cut and gathered by ``convert.py``, from and to the
  whole fused tensors mbridge converts.

A bridge is made without its ``__init__`` (which builds a Transformer Engine config from Megatron's parallel state):
only its tables and format conversions are used, which read the HF config alone. Megatron-Bridge, the other
maintained bridge, requires transformers < 5 and Transformer Engine (docs/guides/moe-parallelism.md).
"""

from __future__ import annotations

import re
import types
import warnings
from typing import Any

import torch

# Local spec -> Transformer Engine spec (mbridge's names): layer norms that TE fuses into the projection they feed.
_TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
# Families mbridge has no bridge of, whose checkpoints name every tensor as another's do.
_SAME_NAMES = {"mistral": "llama"}
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _registry() -> dict[str, type]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mbridge's VLM modules warn about Apex at import
        import mbridge  # noqa: F401 - registers every family
        from mbridge.core.bridge import _MODEL_REGISTRY
    return _MODEL_REGISTRY


class Names:
    """One model's HF names and fused layouts, by mbridge's bridge for its ``model_type``."""

    def __init__(self, hf_config: Any):
        registry = _registry()
        family = _SAME_NAMES.get(hf_config.model_type, hf_config.model_type)
        if family not in registry:
            raise NotImplementedError(
                f"mbridge 0.15.1 has no bridge for model_type {hf_config.model_type!r} (it has {sorted(registry)})"
            )
        self._bridges = [_bare(registry[family], hf_config)]
        if "qwen2" in registry and hf_config.model_type == "qwen2_moe":
            # mbridge's Qwen2-MoE table has no dense MLP (Qwen2-MoE's mlp_only_layers): its Qwen2 table does.
            self._bridges.append(_bare(registry["qwen2"], hf_config))

    def te_name(self, name: str, layer: int | None = None, expert: int | None = None) -> list[str]:
        """mbridge's spellings to try for the local-spec parameter ``name`` of global decoder layer ``layer`` (an
        expert's: global expert ``expert``): the name as it is, then its Transformer Engine spelling."""
        if layer is None:
            return [name]
        suffix = name.split(".", 3)[3]
        pre = f"decoder.layers.{layer}."
        found = _LOCAL_EXPERT.match(suffix)
        if found is not None:
            return [f"{pre}mlp.experts.{found.group(2)}.weight{expert}"]
        return [pre + suffix] + ([pre + _TE_NORMS[suffix]] if suffix in _TE_NORMS else [])

    def lookup(self, candidates: list[str]) -> Mapping:
        """The first of ``candidates`` (``te_name``'s spellings) a bridge maps, with its HF names."""
        for bridge in self._bridges:
            for candidate in candidates:
                try:
                    return Mapping(bridge, candidate, bridge._weight_name_mapping_mcore_to_hf(candidate))
                except NotImplementedError:
                    continue
        raise KeyError(f"mbridge's {type(self._bridges[0]).__name__} maps none of {candidates} to HF names")


class Mapping:
    """One Megatron parameter's HF tensors: their names, and the whole tensor's conversions both ways."""

    def __init__(self, bridge: Any, te_name: str, hf_names: list[str]):
        self._bridge, self.te_name, self.hf_names = bridge, te_name, hf_names

    def to_mcore(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The whole Megatron tensor of the HF ``tensors`` (q/k/v interleaved by group, ``[gate; up]``)."""
        return self._bridge._weight_to_mcore_format(self.te_name, tensors)

    def to_hf(self, whole: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the whole Megatron tensor."""
        names, tensors = self._bridge._weight_to_hf_format(self.te_name, whole)
        return list(zip(names, tensors, strict=True))


def _bare(cls: type, hf_config: Any) -> Any:
    """A bridge with what its tables and format conversions read: no dtype cast, no vocabulary padding (convert.py
    pads), none of the Transformer Engine config its ``__init__`` builds."""
    bridge = cls.__new__(cls)
    bridge.hf_config, bridge.dtype, bridge.extra_args = hf_config, None, {}
    bridge.make_vocab_size_divisible_by = bridge.vocab_size = bridge.padded_vocab_size = None
    # DeepSeek-V3's export asks whether the model has a multi-token-prediction layer: the model built here has none.
    bridge.config = types.SimpleNamespace(mtp_num_layers=0, num_layers=hf_config.num_hidden_layers)
    return bridge
