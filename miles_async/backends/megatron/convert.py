"""HF <-> Megatron-core weights: names, fused layouts and tensor-parallel shards.

Megatron fuses q/k/v into one ``linear_qkv`` whose rows are interleaved by key/value
group (for each group: its query heads, then its key head, then its value head) and
gate/up into one ``linear_fc1`` (``[gate; up]``, per TP shard). Column-parallel weights
are split on dim 0, row-parallel ones on dim 1, the vocabulary (padded to a multiple
of TP) on dim 0; norms are replicated.

Multi-latent attention (DeepSeek-V3) maps one Megatron projection to one HF projection (``_MLA_NAMES``), each
split over TP on its output rows but the output projection.

MoE layers: the router (and GLM's and DeepSeek's expert bias, a buffer: ``expert_bias`` is
``gate.e_score_correction_bias``) and the shared expert (and its gate) are named like the dense
parts; each routed expert is an MLP of its own, ``experts.local_experts.<i>`` (megatron-core's
SequentialMLP; ``experts.linear_fc1.weight<i>`` with Transformer Engine's grouped GEMM),
where local expert ``i`` of expert-parallel rank ``r`` is global expert ``r * E / EP + i``
and its fc1/fc2 are sharded over the expert-tensor-parallel ranks as a dense MLP's over TP.

Load (``load_hf``) reads the HF safetensors lazily and copies each rank's shard into
the model. Export (``export_hf``) is a generator of ``(hf_name, full tensor)``: one
parameter at a time is gathered over the TP group (an expert's over its ETP group, then
its EP group), so with ``iter_buckets`` a weight sync never holds a second full copy of
the model. Every rank of those groups must run the generator (the gathers are collective);
the caller decides who keeps the output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_async.backends.megatron.model import SIGMOID_ROUTER, ArchSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix (local spec / TE spec) -> (kind, HF suffix or None for fused)
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
# Multi-latent attention (DeepSeek-V3): Megatron suffix -> HF suffix. Every projection but the output is
# column-parallel, the down projections included (megatron-core gathers their output); the latent norms whole.
_MLA_NAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MLA_NORMS = ("self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight")
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


def _moe_names(arch: ArchSpec) -> tuple[str, tuple[str, str, str]]:
    """The HF MoE block's attribute and its experts' (gate, up, down) projections."""
    if arch.model_type == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _moe_suffixes(arch: ArchSpec) -> dict[str, tuple[str, ...]]:
    """Megatron suffix -> HF suffixes of the MoE block's router (and its expert bias) and shared expert (fc1: gate,
    up): Qwen2-MoE's ``shared_expert``, GLM's ``shared_experts``."""
    block, _ = _moe_names(arch)
    shared = "mlp.shared_experts." if arch.model_type in SIGMOID_ROUTER else "mlp.shared_expert."
    return {
        "mlp.router.weight": (block + "gate.weight",),
        EXPERT_BIAS: (block + "gate.e_score_correction_bias",),
        "mlp.shared_experts.linear_fc1.weight": (shared + "gate_proj.weight", shared + "up_proj.weight"),
        "mlp.shared_experts.linear_fc2.weight": (shared + "down_proj.weight",),
        "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
    }


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


# -- fused layouts -----------------------------------------------------------------------
def fuse_qkv(arch: ArchSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    tail = q.shape[1:]
    return torch.cat([q.reshape(g, per * hd, *tail), k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1).reshape(
        -1, *tail
    )


def split_qkv(arch: ArchSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * hd, *tail)
    q, k, v = grouped.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_vocab(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


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
    vocab = arch.padded_vocab(tp)
    if name == "embedding.word_embeddings.weight":
        return _pad_vocab(get("model.embed_tokens.weight"), vocab).chunk(tp)[rank]
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return _pad_vocab(get(src), vocab).chunk(tp)[rank]
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF source for Megatron parameter {name}")
    pre = f"model.layers.{layer_number(int(m.group(1)))}."
    suffix = m.group(2)
    if arch.mla is not None and suffix in _MLA_NAMES:
        w = get(pre + _MLA_NAMES[suffix])
        return w if suffix in _MLA_NORMS else w.chunk(tp)[rank]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        fused = fuse_qkv(arch, *(get(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv"))
        return fused.chunk(tp)[rank]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight")
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    expert = _expert(suffix)
    if expert is not None:
        local, fc = expert
        n_local = arch.moe.num_experts // experts.ep
        block, (g, u, d) = _moe_names(arch)
        src = f"{pre}{block}experts.{experts.ep_rank * n_local + local}."
        k, r = experts.etp, experts.etp_rank
        if fc == "linear_fc1":
            return torch.cat([get(f"{src}{g}.weight").chunk(k)[r], get(f"{src}{u}.weight").chunk(k)[r]])
        return get(f"{src}{d}.weight").chunk(k, dim=1)[r]
    moe = _moe_suffixes(arch)
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = (get(pre + n) for n in moe[suffix])
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return get(pre + moe[suffix][0]).chunk(tp, dim=1)[rank]
    if suffix in moe:
        return get(pre + moe[suffix][0])
    if suffix in _LAYER_NAMES:
        w = get(pre + _LAYER_NAMES[suffix])
        return w.chunk(tp, dim=1)[rank] if suffix in _ROW_PARALLEL else w
    raise KeyError(f"no HF source for Megatron parameter {name}")


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
    if tensor_of is None:
        named = weights_and_buffers(model)
    else:
        named = ((n, tensor_of(p)) for n, p in model.named_parameters())
    for name, t in named:
        t = t.detach()
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", _gather(t, 0, group, tp)[: arch.vocab_size]
            continue
        if name == "output_layer.weight":
            if not arch.tie_word_embeddings:
                yield "lm_head.weight", _gather(t, 0, group, tp)[: arch.vocab_size]
            continue
        if name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
            continue
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"no HF name for Megatron parameter {name}")
        pre = f"model.layers.{numbers[int(m.group(1))]}."
        suffix = m.group(2)
        if arch.mla is not None and suffix in _MLA_NAMES:
            yield pre + _MLA_NAMES[suffix], t if suffix in _MLA_NORMS else _gather(t, 0, group, tp)
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            q, k, v = split_qkv(arch, _gather(t, 0, group, tp))
            yield from ((f"{pre}self_attn.{n}_proj.{kind}", x) for n, x in zip("qkv", (q, k, v)))
        elif suffix == "mlp.linear_fc1.weight":
            yield from zip((pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"), _split_fc1(t, group, tp))
        elif (expert := _expert(suffix)) is not None:
            yield from _export_expert(arch, pre, *expert, t, experts)
        elif suffix in (moe := _moe_suffixes(arch)):
            names = [pre + n for n in moe[suffix]]
            if suffix == "mlp.shared_experts.linear_fc1.weight":
                yield from zip(names, _split_fc1(t, group, tp))
            else:
                yield names[0], _gather(t, 1, group, tp) if suffix.endswith("linear_fc2.weight") else t
        elif suffix in _LAYER_NAMES:
            yield pre + _LAYER_NAMES[suffix], _gather(t, 1, group, tp) if suffix in _ROW_PARALLEL else t
        else:
            raise KeyError(f"no HF name for Megatron parameter {name}")


def _split_fc1(t: torch.Tensor, group, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's fused ``[gate; up]`` (per shard) gathered over ``group``: the whole gate and up."""
    parts = [t] if tp == 1 else list(_gather(t, 0, group, tp).chunk(tp))
    half = t.shape[0] // 2
    return torch.cat([s[:half] for s in parts]), torch.cat([s[half:] for s in parts])


def _export_expert(
    arch: ArchSpec, pre: str, local: int, fc: str, t: torch.Tensor, experts: ExpertLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Local expert ``local``'s projection ``fc`` on every EP rank: whole (gathered over ETP), under HF names."""
    block, (g, u, d) = _moe_names(arch)
    n_local = arch.moe.num_experts // experts.ep
    if fc == "linear_fc1":
        whole = torch.cat(_split_fc1(t, experts.etp_group, experts.etp))
    else:
        whole = _gather(t, 1, experts.etp_group, experts.etp)
    for r, w in enumerate(_gather(whole, 0, experts.ep_group, experts.ep).chunk(experts.ep)):
        src = f"{pre}{block}experts.{r * n_local + local}."
        if fc == "linear_fc1":
            gate, up = w.chunk(2)
            yield f"{src}{g}.weight", gate
            yield f"{src}{u}.weight", up
        else:
            yield f"{src}{d}.weight", w
