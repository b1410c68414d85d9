"""Rollout routing replay (R3, ``--use-rollout-routing-replay``): the policy's passes route each token to the experts
the engine's router chose when it generated the sample, instead of their own top-k.

An MoE policy's routers sit near ties for some tokens; the engine (other kernels, another batch, bf16) and the
trainer then pick different experts for them, and the trainer's log-prob of a token is that of another function
than the one that sampled it. Replaying the rollout's choice makes both the same function up to float rounding.
The router still learns: each replayed expert's weight is the router's own probability of it (a gather of its
scores), so the gradient reaches the router through the weights of the experts the rollout used.

A sample's record (``Sample.routed_experts``, SGLang's layout) is ``[len(tokens) - 1, num_hidden_layers, topk]``:
position ``t`` holds the experts of every layer for token ``t`` (the last token was never run through the model).
Each backend lays a micro-batch's tokens out its own way; ``targets`` maps the records through the layout's
``source`` (which sample's which token sits at each input position) into one ``[positions, layers, topk]`` tensor
in the model's token order, ``-1`` where a position has no record (padding, the last token): there the router keeps
its own choice.

Before replacing its choice, each router counts how many of its own top-k experts the rollout also chose
(``ReplayStats``): the agreement between trainer and rollout routing that R3 removes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from miles_async.utils.moe_routers import find_routers

NO_RECORD = -1


@dataclass
class ReplayStats:
    """Counts over the replayed (token, layer) pairs of the passes it saw."""

    agreed: int = 0  # of the router's own top-k experts, those the rollout also chose
    chosen: int = 0  # top-k experts in all
    replayed_tokens: int = 0  # (token, layer) pairs routed by the record

    def add(self, own: torch.Tensor, target: torch.Tensor) -> None:
        """``own`` and ``target``: ``[tokens, topk]`` expert indices of the recorded tokens."""
        if own.numel() == 0:
            return
        self.agreed += int((own[:, :, None] == target[:, None, :]).any(-1).sum())
        self.chosen += own.numel()
        self.replayed_tokens += own.shape[0]

    def metrics(self) -> dict[str, float]:
        """``routing_agreement``: the fraction of the trainer's own top-k choices the rollout made too."""
        if not self.chosen:
            return {}
        return {"routing_agreement": self.agreed / self.chosen, "routing_replayed_tokens": float(self.replayed_tokens)}


def records_for(batch: Any, idx: Sequence[int]) -> list[np.ndarray]:
    """The samples ``idx``'s records, each checked against its tokens; a clear error for a sample without one."""
    column = getattr(batch, "routed_experts", None)
    out = []
    for i in idx:
        record = column[i] if column is not None else None
        expected = len(batch.tokens[i]) - 1
        if record is None or len(record) != expected:
            got = "none" if record is None else f"{len(record)} positions"
            raise ValueError(
                f"--use-rollout-routing-replay: sample uid={batch.uids[i]} (index {i} of the rollout) has a routing "
                f"record of {got} for {expected} positions (its tokens but the last); the engine records it when "
                f"asked, and a custom generate function must keep Sample.routed_experts aligned with its tokens"
            )
        out.append(record)
    return out


def targets(records: Sequence[np.ndarray], source_row: torch.Tensor, source_pos: torch.Tensor) -> torch.Tensor:
    """``[*source.shape, layers, topk]``: for each input position, the record of the token there (``source_row``:
    the row of ``records``, ``source_pos``: the token's position in its sample, -1 for padding), ``NO_RECORD``
    where there is none."""
    layers, topk = records[0].shape[1:]
    table = torch.full((len(records), max(len(r) for r in records) + 1, layers, topk), NO_RECORD, dtype=torch.long)
    for i, r in enumerate(records):
        table[i, : len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
    pos = torch.where(source_pos < 0, table.shape[1] - 1, source_pos.clamp(max=table.shape[1] - 1))
    return table[source_row.clamp(min=0), pos]


def merged(own: torch.Tensor, target: torch.Tensor, stats: ReplayStats | None) -> torch.Tensor:
    """The rollout's experts where it recorded some, the router's own elsewhere; counts agreement first."""
    has = (target >= 0).all(dim=-1)
    if stats is not None:
        stats.add(own[has], target[has])
    return torch.where(has[:, None], target.to(own.device), own)


# -- Hugging Face models (the torch backend) ----------------------------------------------------------------------
def hf_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every MoE layer, in layer order (``utils/moe_routers.py``)."""
    by_layer, unsupported = find_routers(model)
    if unsupported:
        raise ValueError(f"--use-rollout-routing-replay: {unsupported[0]} has no router returning its top-k experts")
    return sorted(by_layer.items())


def hf_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The weights the router gives the experts ``indices`` (its own computation with those experts chosen): a
    sigmoid router with an expert bias (DeepSeek-V3, GLM-4.5) weighs each by its unbiased score, normalised and
    scaled; a softmax router (Qwen-MoE, Mixtral) by its probability, normalised when the model says so."""
    if hasattr(router, "e_score_correction_bias"):
        weights = logits.float().sigmoid().gather(1, indices)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits.float(), dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always normalises and has no such attribute
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


class Replayer:
    """Routes a model's MoE layers by a record, pass by pass: ``install`` once on each policy model, ``set`` before a
    micro-batch's forward. The target stays until the next ``set`` or ``clear``, so that a backward that recomputes
    the forward (activation checkpointing) routes it the same way."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.stats: ReplayStats | None = None

    def set(self, target: torch.Tensor | None, stats: ReplayStats | None = None) -> None:
        self.target, self.stats = target, stats

    def clear(self) -> None:
        self.set(None)

    def install_hf(self, model: torch.nn.Module) -> None:
        """Hooks on the routers of an HF model, whose target is ``[tokens, layers, topk]`` in its token order: batch
        row major, as each MoE block flattens its ``[batch, seq, hidden]`` input."""
        routers = hf_routers(model)
        if not routers:
            raise ValueError("--use-rollout-routing-replay: the policy has no MoE router (a *TopKRouter module)")
        for layer, router in routers:
            router.register_forward_hook(self._hf_hook(layer))

    def _hf_hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: tuple) -> tuple | None:
            if self.target is None:
                return None
            logits, weights, own = output
            chosen = merged(own, self.target[:, layer].to(own.device), self.stats)
            return logits, hf_weights(module, logits, chosen).to(weights.dtype), chosen

        return hook

    def install_megatron(self, model: torch.nn.Module) -> None:
        """megatron-core's routing replay on this stage's routers (a model built with ``moe_enable_routing_replay``),
        whose target is ``[tokens, layers, topk]`` in the router's token order: sequence major, ``s * batch + b``,
        this rank's share of the sequence."""
        routers = megatron_routers(model)
        if not routers:
            raise ValueError("--use-rollout-routing-replay: the model was built without megatron-core's RouterReplay")
        for layer, router in routers:
            router.router_replay.get_replay_topk = self._megatron_topk(layer)

    def _megatron_topk(self, layer: int) -> Callable:
        """megatron-core's ``RouterReplay.get_replay_topk``: its own top-k (group-limited where configured) without a
        target or where the target has no record, the record elsewhere, the values gathered from the router's scores
        as megatron-core's REPLAY_FORWARD does."""

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.target is None:
                return values, own
            chosen = merged(own, self.target[:, layer].to(scores.device), self.stats)
            return scores.gather(1, chosen), chosen

        return get_replay_topk


# -- Megatron-core (the megatron backend) ---------------------------------------------------------------------------
def megatron_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(0-based global layer index, router) of this pipeline stage's MoE layers, for a model built with
    ``moe_enable_routing_replay`` (each router holds a megatron-core ``RouterReplay``)."""
    out = []
    for module in model.modules():
        if getattr(module, "router_replay", None) is not None and getattr(module, "layer_number", None) is not None:
            out.append((module.layer_number - 1, module))
    return out
