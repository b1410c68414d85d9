"""The routing an independent transformers forward chooses, to compare an engine's recorded routing with."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def routing_reference(model: Any, ids: list[int], tie: float) -> tuple[np.ndarray, np.ndarray]:
    """(experts, clear) of an HF forward of ``ids``: ``[N, layers, k]`` experts (0 for a dense layer, as SGLang
    records one) and ``[N, layers]`` whether that top-k set is clear of a tie by more than ``tie`` (a sigmoid router
    ranks by score plus its expert bias, a softmax router by probability), from hooks on the routers' outputs."""
    k = model.config.num_experts_per_tok
    layers = model.model.layers
    experts = np.zeros((len(ids), len(layers), k), dtype=np.int32)
    clear = np.ones((len(ids), len(layers)), dtype=bool)
    hooks = []
    for i, layer in enumerate(layers):
        if not hasattr(layer.mlp, "experts"):
            continue

        def keep(module: Any, _args: Any, out: Any, i: int = i) -> None:
            logits, _, idx = out
            if hasattr(module, "e_score_correction_bias"):
                scores = logits.float().sigmoid() + module.e_score_correction_bias
            else:
                scores = logits.float().softmax(-1)
            top = scores.topk(k + 1, dim=-1).values
            clear[:, i] = (top[:, k - 1] - top[:, k] > tie).numpy()
            experts[:, i] = idx.numpy()

        hooks.append(layer.mlp.gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return experts, clear
