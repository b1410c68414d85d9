"""Checkpoints of the torch backend through ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards of the weights and the optimizer state, keyed by parameter name, so a
checkpoint saved by N workers loads into M (DCP reshards on load). A background save copies the shards to
host memory at the step boundary and writes them on a thread of DCP's; a separate gloo group carries that
thread's collectives, which would otherwise interleave with the training's.

A role's folder: ``dcp/`` (DCP's files), ``train_state.pt`` (the LR schedule and the optimizer step count,
rank 0) and ``rng_rank<r>.pt`` per rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DCP_DIR = "dcp"
LEGACY_WEIGHTS = "model.safetensors"


# Optimizer options that pick an implementation rather than change the update.
_KERNEL_CHOICES = ("fused", "foreach", "capturable", "differentiable")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns on every call of a single process that it assumes no process group: that is what 1 worker means.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(trained_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trained_only)


def state_of(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trained_only: bool = False
) -> dict[str, Any]:
    """The module's (and optimizer's) state keyed by parameter name, with sharded tensors left sharded;
    ``trained_only``: without the frozen weights (LoRA's base model, which --hf-checkpoint holds)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        model, optim = get_model_state_dict(module, options=_options(trained_only)), None
    else:
        model, optim = get_state_dict(module, optimizer, options=_options(trained_only))
    if trained_only:  # a frozen weight tied to another (the head to the embeddings) would still be listed
        trained = {name for name, p in module.named_parameters() if p.requires_grad}
        model = {k: v for k, v in model.items() if k in trained}
    return {"model": model} if optim is None else {"model": model, "optim": optim}


def save(state: dict[str, Any], folder: Path, group: dist.ProcessGroup | None, background: bool) -> Future | None:
    """Writes ``state`` (``state_of``) into ``folder``/dcp. With ``background`` the shards are copied to host
    memory now and written on a thread: the returned future completes when they are on disk."""
    import torch.distributed.checkpoint as dcp

    target = str(folder / DCP_DIR)
    with _quiet():
        if background:
            return dcp.async_save(state, checkpoint_id=target, process_group=group)
        dcp.save(state, checkpoint_id=target, process_group=group)
        return None


def missing_weights(folder: Path, role: str) -> str | None:
    """Why ``folder`` cannot be loaded by ``load``, or None when it can."""
    if (folder / DCP_DIR / ".metadata").exists():
        return None
    if (folder / LEGACY_WEIGHTS).exists():
        return (
            f"{folder} is in the single-file format of miles-async before sharded checkpoints "
            f"({LEGACY_WEIGHTS}); resume it with that version"
        )
    return f"{folder} holds no {role} weights (no {DCP_DIR}/.metadata)"


def has_optimizer(folder: Path) -> bool:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder / DCP_DIR)).read_metadata()
    return any(key.startswith("optim") for key in metadata.state_dict_metadata)


def load(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    folder: Path,
    group: dist.ProcessGroup | None,
    trained_only: bool = False,
) -> None:
    """Loads ``folder``'s weights (and optimizer state when ``optimizer`` is given) into this rank's shards,
    whatever number of workers wrote them (``trained_only`` as ``state_of``'s)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    state = state_of(module, optimizer, trained_only)
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR), process_group=group)
    options = StateDictOptions(strict=not trained_only, ignore_frozen_params=trained_only)
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=options)
    else:
        # The kernel choices describe this machine, not the training state: a checkpoint written before the
        # optimizer was fused (or on another device) would otherwise bring its slower loop back with it.
        kernels = [{k: g[k] for k in _KERNEL_CHOICES if k in g} for g in optimizer.param_groups]
        set_state_dict(
            module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        for g, kept in zip(optimizer.param_groups, kernels, strict=True):
            g.update(kept)
