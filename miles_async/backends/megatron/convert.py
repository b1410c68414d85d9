"""HF <-> Megatron-core weights: names, fused layouts and tensor-parallel shards.

Megatron fuses q/k/v into one ``linear_qkv`` whose rows are interleaved by key/value
group (for each group: its query heads, then its key head, then its value head) and
gate/up into one ``linear_fc1`` (``[gate; up]``, per TP shard). Column-parallel weights
are split on dim 0, row-parallel ones on dim 1, the vocabulary (padded to a multiple
of TP) on dim 0; norms are replicated.

Load (``load_hf``) reads the HF safetensors lazily and copies each rank's shard into
the model. Export (``export_hf``) is a generator of ``(hf_name, full tensor)``: one
parameter at a time is gathered over the TP group, so with ``iter_buckets`` a weight
sync never holds a second full copy of the model. Every rank of a TP group must run
the generator (the gathers are collective); the caller decides who keeps the output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from miles_async.backends.megatron.model import ArchSpec

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
) -> torch.Tensor:
    """This TP rank's value of Megatron parameter ``name``, read from HF tensors through ``get``."""
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
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        fused = fuse_qkv(arch, *(get(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv"))
        return fused.chunk(tp)[rank]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight")
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
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
def load_hf(model, get: Callable[[str], torch.Tensor], arch: ArchSpec, tp: int, rank: int) -> None:
    numbers = _layer_numbers(model)
    for name, p in model.named_parameters():
        value = hf_shard(name, get, arch, tp, rank, layer_number=numbers.__getitem__)
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
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every parameter of ``model``, gathered over the TP group.

    ``tensor_of`` picks what is exported per parameter (default the weight; e.g. its
    gradient ``p.main_grad`` to compare gradients across parallel layouts).
    """
    numbers = _layer_numbers(model)
    for name, p in model.named_parameters():
        t = tensor_of(p).detach()
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
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            q, k, v = split_qkv(arch, _gather(t, 0, group, tp))
            yield from ((f"{pre}self_attn.{n}_proj.{kind}", x) for n, x in zip("qkv", (q, k, v)))
        elif suffix == "mlp.linear_fc1.weight":
            parts = [t] if tp == 1 else list(_gather(t, 0, group, tp).chunk(tp))
            half = t.shape[0] // 2
            yield pre + "mlp.gate_proj.weight", torch.cat([s[:half] for s in parts])
            yield pre + "mlp.up_proj.weight", torch.cat([s[half:] for s in parts])
        elif suffix in _LAYER_NAMES:
            yield pre + _LAYER_NAMES[suffix], _gather(t, 1, group, tp) if suffix in _ROW_PARALLEL else t
        else:
            raise KeyError(f"no HF name for Megatron parameter {name}")
