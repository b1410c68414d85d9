"""HF <-> Megatron-core weights: tensor-parallel, expert-parallel and pipeline shards.

Which HF tensors make each Megatron parameter, and how they fuse (q/k/v interleaved by key/value group, ``[gate;
up]``), is mbridge's, per family (``bridge.py``). This module cuts each whole Megatron tensor into this rank's
shard and gathers it back: column-parallel weights (q/k/v, multi-latent attention's projections) split on dim 0,
row-parallel ones (attention output, MLP down projections) on dim 1, a gated MLP's ``[gate; up]`` as each of
gate and up split on dim 0 (each rank holds ``[gate shard; up shard]``), the vocabulary (padded to a multiple of
TP) on dim 0; norms, routers and expert biases are whole on every rank.

MoE layers: each routed expert is an MLP of its own, ``experts.local_experts.<i>`` (megatron-core's
SequentialMLP), where local expert ``i`` of expert-parallel rank ``r`` is global expert ``r * E / EP + i`` and its
fc1/fc2 are sharded over the expert-tensor-parallel ranks as a dense MLP's over TP. GLM's and DeepSeek's expert
bias is a buffer (``mlp.router.expert_bias``), which the checkpoint and the engines hold with the weights.

Load (``load_hf``) reads the HF safetensors lazily and copies each rank's shard into the model. Export
(``export_hf``) is a generator of ``(hf_name, full tensor)``: one parameter at a time is gathered over the TP group
(an expert's over its ETP group, then its EP group), so with ``iter_buckets`` a weight sync never holds a second full
copy of the model. Every rank of those groups must run the generator (the gathers are collective); the caller
decides who keeps the output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_async.backends.megatron.model import ArchSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight")
_GATE_UP = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")
# Column-parallel: split on their output rows (multi-latent attention's down projections too: megatron-core gathers
# their output).
_COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.weight",
)
# A routed expert's projection: local spec (SequentialMLP) or Transformer Engine's grouped GEMM.
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


@dataclass(frozen=True)
class ExpertLayout:
    """How this rank holds the routed experts: ``ep`` expert-parallel ranks (this one ``ep_rank``), each expert's
    projections split over ``etp`` expert-tensor-parallel ranks; the groups for the export's gathers."""

    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    ep_group: Any = None
    etp_group: Any = None

    @classmethod
    def current(cls) -> ExpertLayout:
        """This rank's, from Megatron's parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_model_parallel_group(),
            ps.get_expert_tensor_parallel_group(),
        )


# GLM's router bias: a buffer (not trained by the optimizer; Megatron moves it by --moe-router-bias-update-rate),
# replicated on every rank, which the checkpoint and the engines hold with the weights.
EXPERT_BIAS = "mlp.router.expert_bias"


def weights_and_buffers(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, then every router's expert bias: the tensors the HF checkpoint holds for ``model``."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name.endswith("." + EXPERT_BIAS) and buf is not None:
            yield name, buf


def _expert(suffix: str) -> tuple[int, str] | None:
    """(local expert index, "linear_fc1" | "linear_fc2") of a routed expert's projection, else None."""
    m = _EXPERT.match(suffix)
    if m is None:
        return None
    return (int(m.group(1)), m.group(2)) if m.group(1) is not None else (int(m.group(4)), m.group(3))


# -- shards -------------------------------------------------------------------------------
def _pad_vocab(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _cut(whole: torch.Tensor, suffix: str, k: int, r: int) -> torch.Tensor:
    """Rank ``r`` of ``k``'s shard of the whole Megatron tensor of parameter ``suffix``."""
    if k == 1:
        return whole
    if suffix in _ROW_PARALLEL or suffix == "linear_fc2":
        return whole.chunk(k, dim=1)[r]
    if suffix in _GATE_UP or suffix == "linear_fc1":
        gate, up = whole.chunk(2)
        return torch.cat([gate.chunk(k)[r], up.chunk(k)[r]])
    if suffix in _COLUMN_PARALLEL:
        return whole.chunk(k)[r]
    return whole


def _uncut(t: torch.Tensor, suffix: str, group, k: int) -> torch.Tensor:
    """The whole Megatron tensor of parameter ``suffix`` from every rank's shard ``t`` in ``group`` (``_cut``'s
    inverse; collective)."""
    if k == 1:
        return t
    if suffix in _ROW_PARALLEL or suffix == "linear_fc2":
        return _gather(t, 1, group, k)
    if suffix in _GATE_UP or suffix == "linear_fc1":
        parts = _gather(t, 0, group, k).chunk(k)
        half = t.shape[0] // 2
        return torch.cat([*(p[:half] for p in parts), *(p[half:] for p in parts)])
    if suffix in _COLUMN_PARALLEL:
        return _gather(t, 0, group, k)
    return t


# -- HF -> Megatron ------------------------------------------------------------------------
def hf_shard(
    name: str,
    get: Callable[[str], torch.Tensor],
    arch: ArchSpec,
    tp: int,
    rank: int,
    layer_number: Callable[[int], int] = lambda i: i,
    experts: ExpertLayout = ExpertLayout(),
) -> torch.Tensor:
    """This TP rank's value of Megatron parameter ``name``, read from HF tensors through ``get`` (a routed expert's:
    this EP and ETP rank's, by ``experts``)."""
    names = arch.names
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        src = names.lookup([name]).hf_names[0]
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            src = names.lookup(["embedding.word_embeddings.weight"]).hf_names[0]
        return _pad_vocab(get(src), arch.padded_vocab(tp)).chunk(tp)[rank]
    m = _LAYER.match(name)
    if m is None:
        mapping = names.lookup([name])
        return mapping.to_mcore([get(n) for n in mapping.hf_names])
    suffix = m.group(2)
    expert = _expert(suffix)
    if expert is None:
        mapping = names.lookup(names.te_name(name, layer_number(int(m.group(1)))))
        return _cut(mapping.to_mcore([get(n) for n in mapping.hf_names]), suffix, tp, rank)
    local, fc = expert
    global_expert = experts.ep_rank * (arch.moe.num_experts // experts.ep) + local
    mapping = names.lookup(names.te_name(name, layer_number(int(m.group(1))), global_expert))
    return _cut(mapping.to_mcore([get(n) for n in mapping.hf_names]), fc, experts.etp, experts.etp_rank)


class HFReader:
    """Lazy reader of an HF folder's safetensors (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(path / "model.safetensors"), "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        self._files = {name: safe_open(str(path / name), "pt") for name in set(weight_map.values())}
        self._map = weight_map

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._map:
            raise KeyError(f"HF checkpoint has no tensor {name}")
        return self._files[self._map[name]].get_tensor(name).float()

    def keys(self):
        return self._map.keys()


def _layer_numbers(model) -> dict[int, int]:
    """Local layer index -> global (0-based) layer number, so pipeline stages map correctly."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


@torch.no_grad()
def load_hf(
    model,
    get: Callable[[str], torch.Tensor],
    arch: ArchSpec,
    tp: int,
    rank: int,
    experts: ExpertLayout = ExpertLayout(),
) -> None:
    numbers = _layer_numbers(model)
    for name, p in weights_and_buffers(model):
        value = hf_shard(name, get, arch, tp, rank, layer_number=numbers.__getitem__, experts=experts)
        if value.shape != p.shape:
            raise ValueError(f"{name}: HF gives {tuple(value.shape)}, the model has {tuple(p.shape)}")
        p.data.copy_(value.to(p.dtype))


# -- Megatron -> HF ------------------------------------------------------------------------
def _gather(t: torch.Tensor, dim: int, group, tp: int) -> torch.Tensor:
    if tp == 1:
        return t
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def export_hf(
    model,
    arch: ArchSpec,
    tp: int = 1,
    group=None,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
    experts: ExpertLayout = ExpertLayout(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every parameter of ``model``, gathered over the TP group (a routed expert's
    over its ETP group, then its EP group: every expert of the layer), and every router's expert bias.

    ``tensor_of`` picks what is exported per parameter instead of the weights (e.g. its gradient ``p.main_grad``
    to compare gradients across parallel layouts); the expert biases, which have none, are then left out.
    """
    numbers = _layer_numbers(model)
    names = arch.names
    if tensor_of is None:
        named = weights_and_buffers(model)
    else:
        named = ((n, tensor_of(p)) for n, p in model.named_parameters())
    for name, t in named:
        t = t.detach()
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name == "embedding.word_embeddings.weight" or not arch.tie_word_embeddings:
                hf = names.lookup([name]).hf_names[0]
                yield hf, _gather(t, 0, group, tp)[: arch.vocab_size]
            continue
        m = _LAYER.match(name)
        if m is None:
            yield from names.lookup([name]).to_hf(t)
            continue
        layer, suffix = numbers[int(m.group(1))], m.group(2)
        expert = _expert(suffix)
        if expert is None:
            yield from names.lookup(names.te_name(name, layer)).to_hf(_uncut(t, suffix, group, tp))
            continue
        local, fc = expert
        whole = _uncut(t, fc, experts.etp_group, experts.etp)
        n_local = arch.moe.num_experts // experts.ep
        for r, w in enumerate(_gather(whole, 0, experts.ep_group, experts.ep).chunk(experts.ep)):
            yield from names.lookup(names.te_name(name, layer, r * n_local + local)).to_hf(w)
