"""FSDP2 for the torch backend: every transformer block and the root sharded over the data-parallel ranks.

Each rank keeps 1/N of every parameter (a ``DTensor`` sharded on dim 0), of its gradient and of the optimizer
state built on it; a block's full weights exist only while its forward or backward runs. With --bf16 the
gathered weights are cast to bf16 for compute while the shards (the master weights) and the gradient
reduction stay fp32; --fsdp-cpu-offload keeps the shards, gradients and optimizer state in host memory.

Every forward and backward of a sharded model is a collective: all ranks must run the same number of them,
which ``packing.even_out`` arranges for the micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from miles_async.backends.fsdp.vision import tower_in_every_pass


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: HF names their classes in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"--train-backend fsdp: {type(model).__name__} names no transformer block class (_no_split_modules), "
            "so there is nothing to shard block by block"
        )
    return blocks


def shard_model(
    model: torch.nn.Module, world_size: int, device: torch.device, bf16: bool, cpu_offload: bool
) -> torch.nn.Module:
    """``model`` with ``fully_shard`` applied to each block and to the root (in place: FSDP2 changes the
    module's class and swaps its parameters for sharded ones, so build the optimizer afterwards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32),
        # Pinned host memory needs an accelerator; on a CPU-only run the shards are in host memory anyway.
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    }
    for block in _blocks(model):
        fully_shard(block, **options)
    # The root holds what is outside the blocks: embeddings, the final norm and the (possibly tied) head.
    fully_shard(model, **options)
    tower_in_every_pass(model)  # a VLM's tower blocks take part in every pass, images or not
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank when sharded (a collective), else ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when unsharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for each parameter, gathered one at a time: no rank holds more than one parameter
    beyond its shards. Every rank must drain it (the gathers are collectives)."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p.detach())


def total_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm over every gradient, sharded ones reduced over their ranks."""
    return float(full_tensor(torch.nn.utils.get_total_norm(grads)))
