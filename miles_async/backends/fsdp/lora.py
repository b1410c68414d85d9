"""LoRA on the torch backend (--lora-rank), built on peft.

The adapters are injected into the HF model in place (``peft.inject_adapter_in_model``): the model keeps its
class, forward and ``_no_split_modules``, so FSDP2 shards it as any other, and its parameter names only gain
``.base_layer`` / ``.lora_A.default`` / ``.lora_B.default``. Only the adapters train; checkpoints hold only them.

Engines always get merged weights (W + scaling * B @ A under the model's own HF names), by every route: one
weight path for every engine, no per-token adapter cost in generation, and the embedded engine needs no LoRA
kernels. SGLang and vLLM could load the adapter instead (fewer bytes per update); that is not done here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from miles_async.backends.fsdp.sharding import full_tensor
from miles_async.backends.fsdp.vision import find_vision_tower
from miles_async.config.train import LoraSettings

ADAPTER = "default"  # peft's name of the one adapter
ALL_LINEAR = "all-linear"


def _peft_config(lora: LoraSettings, base_model: str | None = None):
    """The one peft ``LoraConfig`` of --lora-*: what the adapters are built from and what their folder records."""
    from peft import LoraConfig

    targets = ALL_LINEAR if lora.target_modules == (ALL_LINEAR,) else list(lora.target_modules)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def add_adapters(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """``model`` with LoRA adapters on its target linear layers (B starts at zero, so the model is unchanged),
    everything else frozen; a VLM's vision tower takes none."""
    from peft import inject_adapter_in_model

    config = _peft_config(lora)
    tower = find_vision_tower(model)
    if tower is not None:
        # A VLM's adapters go on its language model: the vision tower stays as loaded (as Miles and verl do).
        config.exclude_modules = rf"{re.escape(tower[0])}(\..*)?"
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft names the modules it could not find
        raise ValueError(f"--lora-target-modules {','.join(lora.target_modules)}: {e}") from e
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    _check_linear(model)
    return model


def _check_linear(model: torch.nn.Module) -> None:
    from peft.tuners.lora import Linear, LoraLayer, ParamWrapper

    other = [
        n for n, m in model.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, (Linear, ParamWrapper))
    ]
    if other:
        raise ValueError(f"--lora-target-modules: only linear layers take adapters here, not {other[:3]}")


def merged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of the model with each adapter merged into its layer's weight, gathered one
    layer at a time (sharded tensors are collectives: every rank must drain it)."""
    from peft.tuners.lora import Linear, ParamWrapper

    seen: set[int] = set()  # tied weights (embeddings and head) go once, as named_parameters() gives them
    merged: tuple[str, ...] = ()  # prefixes of the LoRA layers yielded: their base layers and adapters follow
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if merged and prefix.startswith(merged):
            continue
        if isinstance(module, Linear):
            base = module.base_layer
            weight = full_tensor(base.weight.detach())
            a = full_tensor(module.lora_A[ADAPTER].weight.detach())
            b = full_tensor(module.lora_B[ADAPTER].weight.detach())
            yield f"{prefix}weight", weight + (b @ a) * module.scaling[ADAPTER]
            if base.bias is not None:
                yield f"{prefix}bias", full_tensor(base.bias.detach())
            merged += (prefix,)
            continue
        if isinstance(module, ParamWrapper):
            yield from _merged_wrapped(module, prefix)
            merged += (prefix,)
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}{name}", full_tensor(p.detach())


def _merged_wrapped(wrapper: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of the module under a chain of peft ``ParamWrapper``s (adapters on parameters rather than on
    linear layers: an MoE layer's fused experts ``gate_up_proj`` and ``down_proj`` [experts, out, in], its router's
    weight), each adapted one merged with its adapter (peft's own delta, one rank-r update per expert), under the
    wrapped module's names."""
    from peft.tuners.lora import ParamWrapper

    deltas: dict[str, torch.Tensor] = {}
    inner = wrapper
    while isinstance(inner, ParamWrapper):
        # The factors are sharded like any parameter: peft's delta of sharded tensors is gathered whole.
        deltas[inner.parameter_name] = full_tensor(inner.get_delta_weight(ADAPTER).detach())
        inner = inner.base_layer
    for name, p in inner.named_parameters():
        weight = full_tensor(p.detach())
        yield f"{prefix}{name}", weight + deltas[name] if name in deltas else weight


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters under PEFT's saved names (``base_model.model.<layer>.lora_A.weight``), gathered."""
    for name, p in model.named_parameters():
        if ".lora_" in name:
            yield f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}", full_tensor(p.detach())


def write_adapter(named: Iterator[tuple[str, torch.Tensor]], lora: LoraSettings, base_model: str, out: str) -> None:
    """A PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``) that ``peft``, SGLang and
    vLLM load on top of ``base_model``."""
    from safetensors.torch import save_file

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in named}, str(path / "adapter_model.safetensors"))
    _peft_config(lora, base_model).save_pretrained(str(path))
