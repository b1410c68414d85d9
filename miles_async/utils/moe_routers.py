"""The MoE routers of a transformers 5 model, by decoder layer: what the embedded engine records routing from and
what the torch backend replays it into (rollout routing replay).

transformers 5's MoE blocks (Qwen2/3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, ...) are a module with ``experts`` and a
router ``gate`` that returns ``(router_logits, weights, indices)``, ``indices`` ``[tokens, top_k]`` over the block's
input flattened batch-row major (``[B, S, H]`` -> ``[B * S, H]``). The layer of a router is the last ``layers.<i>``
of its name. A router peft wraps (LoRA on its weight) is returned unwrapped: the wrapper calls it.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def find_routers(model: torch.nn.Module) -> tuple[dict[int, torch.nn.Module], list[str]]:
    """(decoder layer -> router of each MoE block, the MoE blocks whose router is not such a ``gate``, e.g. GPT-OSS's
    or Llama 4's ``router``, by name and class)."""
    by_layer: dict[int, torch.nn.Module] = {}
    unsupported: list[str] = []
    for name, module in model.named_modules():
        found = _LAYER.findall(name)
        if not found or not isinstance(getattr(module, "experts", None), torch.nn.Module):
            continue
        gate = getattr(module, "gate", None)
        if isinstance(gate, torch.nn.Module) and not isinstance(gate, torch.nn.Linear):
            by_layer[int(found[-1])] = gate.get_base_layer() if hasattr(gate, "get_base_layer") else gate
        else:
            unsupported.append(f"{name} ({type(module).__name__})")
    return by_layer, unsupported
