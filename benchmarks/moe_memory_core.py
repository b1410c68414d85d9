"""Where an MoE model's training state goes under a Megatron layout (TP x PP x EP x expert TP, data parallel over
the rest), counted from its ``config.json``: the pure part of ``benchmarks/train_memory_moe.py``, which checks these
counts against the tensors megatron-core really allocates on each rank of a tiny model over gloo, and then projects
them to Qwen3-30B-A3B on GPUs.

Per rank, the state between steps is
- parameters: every parameter of its pipeline stage, the dense ones (attention, norms, router, embeddings, dense
  MLPs) split over TP as megatron-core splits them, its ``experts / EP`` routed experts split over expert TP;
- gradients: Megatron's DDP keeps a gradient buffer the size of the rank's parameters (fp32 here, as the backend
  sets ``grad_reduce_in_fp32``);
- optimizer: Adam's two moments, plus fp32 master weights when the parameters are bf16. The distributed optimizer
  shards them over data parallelism (dense parameters) and expert data parallelism (routed experts: ``world /
  (PP x EP x expert TP)`` ranks), which is why EP and distributed optimizer together are what fit a large MoE.
Activations, communication buffers and allocator slack are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEShape:
    """What decides a qwen3_moe-style model's parameter counts (Mixtral's and Qwen2-MoE's are the same shape, with
    no q/k norms and, for Qwen2-MoE, a shared expert left out here)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    expert_ffn: int
    dense_ffn: int
    moe_layers: tuple[bool, ...]
    tied: bool
    qk_norm: bool

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> MoEShape:
        layers = config["num_hidden_layers"]
        step = config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers") or ())
        return cls(
            vocab=config["vocab_size"],
            hidden=config["hidden_size"],
            layers=layers,
            heads=config["num_attention_heads"],
            kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            experts=config.get("num_experts") or config["num_local_experts"],
            expert_ffn=config.get("moe_intermediate_size") or config["intermediate_size"],
            dense_ffn=config["intermediate_size"],
            moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type") in ("qwen3_moe",),
        )

    @property
    def total(self) -> int:
        """The model's parameter count (TP 1, one stage, every expert)."""
        stage = stage_params(self, Layout(1, 1, 1), 0)
        return stage.dense + stage.expert


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    etp: int = 1
    world: int = 0  # 0: tp x pp (data parallel 1)

    @property
    def ranks(self) -> int:
        return self.world or self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.ranks // (self.pp * self.ep * self.etp)

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep}" + (f" ETP{self.etp}" if self.etp > 1 else "") + f" DP{self.dp}"


def problems(shape: MoEShape, layout: Layout) -> list[str]:
    """Why megatron-core would refuse ``layout`` for ``shape`` (empty: it builds)."""
    out = []
    if layout.ranks % (layout.tp * layout.pp):
        out.append(f"{layout.ranks} ranks do not split into TP {layout.tp} x PP {layout.pp}")
    if shape.kv_heads % layout.tp or shape.heads % layout.tp:
        out.append(f"{shape.kv_heads} KV heads do not split over TP {layout.tp}")
    if shape.layers % layout.pp:
        out.append(f"{shape.layers} layers do not split into {layout.pp} even stages")
    if shape.experts % layout.ep:
        out.append(f"{shape.experts} experts do not split over EP {layout.ep}")
    if (layout.ranks // layout.pp) % (layout.ep * layout.etp):
        out.append(f"EP {layout.ep} x expert TP {layout.etp} does not divide the {layout.ranks // layout.pp} ranks")
    if shape.expert_ffn % layout.etp:
        out.append(f"the experts' FFN {shape.expert_ffn} does not split over expert TP {layout.etp}")
    return out


@dataclass(frozen=True)
class StageParams:
    dense: int  # elements on one rank of the stage that are not routed experts
    expert: int  # elements of routed experts on one rank of the stage


def stage_params(shape: MoEShape, layout: Layout, stage: int) -> StageParams:
    """Parameter elements on one rank of pipeline ``stage`` (every TP rank holds as many)."""
    tp, h, hd = layout.tp, shape.hidden, shape.head_dim
    per_stage = shape.layers // layout.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    padded_vocab = -(-shape.vocab // tp) * tp  # megatron-core pads the vocabulary to a multiple of TP
    first, last = stage == 0, stage == layout.pp - 1
    dense = 0
    if first:
        dense += padded_vocab // tp * h
    if last:
        dense += h  # the final norm
        # The head: its own weight when untied; tied but on another stage than the embedding, a copy of it.
        if not shape.tied or not first:
            dense += padded_vocab // tp * h
    attention = (shape.heads + 2 * shape.kv_heads) * hd * h // tp + shape.heads * hd * h // tp
    norms = 2 * h + (2 * hd if shape.qk_norm else 0)
    expert = 0
    for i in layers:
        dense += attention + norms
        if shape.moe_layers[i]:
            dense += shape.experts * h  # the router, whole on every rank
            expert += shape.experts // layout.ep * 3 * h * shape.expert_ffn // layout.etp
        else:
            dense += 3 * h * shape.dense_ffn // tp
    return StageParams(dense, expert)


@dataclass(frozen=True)
class Precision:
    param: int  # bytes per parameter element
    grad: int  # bytes per gradient element
    optimizer: int  # Adam's moments (8), and 4 more for fp32 master weights of low-precision parameters
    distributed_optimizer: bool
    optimizer_on_host: bool = False  # --optimizer-cpu-offload (with --optimizer-offload-fraction 1.0)

    @classmethod
    def fp32(cls, distributed_optimizer: bool) -> Precision:
        return cls(4, 4, 8, distributed_optimizer)

    @classmethod
    def bf16(cls, distributed_optimizer: bool = True, optimizer_on_host: bool = False) -> Precision:
        """Miles' GPU runs: bf16 parameters, fp32 gradients and master weights, the distributed optimizer."""
        return cls(2, 4, 12, distributed_optimizer, optimizer_on_host)


@dataclass(frozen=True)
class RankBytes:
    params: int
    grads: int
    optimizer: int
    optimizer_on_host: bool = False

    @property
    def total(self) -> int:
        """What the rank's accelerator holds (its optimizer state too, unless offloaded to host memory)."""
        return self.params + self.grads + (0 if self.optimizer_on_host else self.optimizer)


def rank_bytes(shape: MoEShape, layout: Layout, precision: Precision) -> RankBytes:
    """The state of the fullest rank (the stage with the most bytes)."""
    stages = []
    for stage in range(layout.pp):
        p = stage_params(shape, layout, stage)
        dp, edp = (layout.dp, layout.expert_dp) if precision.distributed_optimizer else (1, 1)
        # Megatron's distributed optimizer gives each rank a contiguous range of the gradient buffer: ceil, the
        # fullest rank's share.
        optimizer = precision.optimizer * (math.ceil(p.dense / dp) + math.ceil(p.expert / edp))
        n = p.dense + p.expert
        stages.append(RankBytes(n * precision.param, n * precision.grad, optimizer, precision.optimizer_on_host))
    return max(stages, key=lambda b: b.total)


def layouts(shape: MoEShape, world: int, max_tp: int = 8) -> Iterator[Layout]:
    """Every layout megatron-core builds for ``shape`` on ``world`` ranks, TP within a node of ``max_tp`` GPUs,
    expert TP 1 (Miles' MoE launchers' choice)."""
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= max_tp):
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            for ep in (e for e in range(1, world + 1) if world % e == 0):
                layout = Layout(tp, pp, ep, 1, world)
                if not problems(shape, layout):
                    yield layout


def choose(shape: MoEShape, world: int, precision: Precision, budget_bytes: float) -> Layout | None:
    """The layout that fits its state in ``budget_bytes`` per GPU with the fewest model-parallel ranks (TP x PP:
    each splits every dense matmul or adds pipeline bubbles), then the smallest EP (the token all-to-all spans
    fewer ranks), then the least state. None when nothing fits."""
    fits = [lay for lay in layouts(shape, world) if rank_bytes(shape, lay, precision).total <= budget_bytes]
    return min(fits, key=lambda lay: (lay.tp * lay.pp, lay.ep, rank_bytes(shape, lay, precision).total), default=None)
