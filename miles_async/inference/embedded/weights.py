"""The embedded engine's weights: HF-named tensors copied into the live model, and checkpoints read from disk.

Names are HF parameter names (``model.state_dict()`` keys); for tied embeddings either or both of
``lm_head.weight`` and ``model.embed_tokens.weight`` may be given.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable

import torch

from miles_async.inference.embedded.records import UnknownParameterError

logger = logging.getLogger(__name__)


def param_table(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, every alias of a tied weight included."""
    # remove_duplicate=False keeps every alias of tied weights, so both
    # lm_head.weight and model.embed_tokens.weight resolve.
    table = dict(model.named_parameters(remove_duplicate=False))
    for name, buf in model.named_buffers(remove_duplicate=False):
        table.setdefault(name, buf)
    return table


def _missing_names(model: torch.nn.Module, given: Iterable[str], known: dict[str, torch.Tensor]) -> list[str]:
    """The model's parameters (one name per storage) that none of the ``given`` names reaches."""
    given_ptrs = {known[n].data_ptr() for n in given if n in known}
    names = dict(model.named_parameters())  # deduplicated: one name per storage
    return [n for n, p in names.items() if p.data_ptr() not in given_ptrs]


def copy_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy named tensors into the model; checks every name and shape before touching anything."""
    table = param_table(model)
    unknown = sorted(n for n in tensors if n not in table)
    if unknown:
        raise UnknownParameterError(unknown)
    bad_shapes = [
        f"{n}: got {tuple(t.shape)}, expected {tuple(table[n].shape)}"
        for n, t in tensors.items()
        if tuple(t.shape) != tuple(table[n].shape)
    ]
    if bad_shapes:
        raise ValueError("shape mismatch: " + "; ".join(bad_shapes))
    with torch.no_grad():
        for name, tensor in tensors.items():
            table[name].copy_(tensor)  # copy_ casts to the model dtype


def read_checkpoint(
    model: torch.nn.Module, model_path: str, dtype: torch.dtype, attn_implementation: str
) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint folder of ``model``'s architecture, named as ``model`` names them.

    When the checkpoint's names do not map 1:1 onto the model (e.g. transformers renames or fuses
    weights on load), the folder is loaded through ``from_pretrained`` and its state dict is used.
    """
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} is not a directory")
    tensors = _read_safetensors_dir(model_path)
    known = param_table(model)
    unknown = [n for n in tensors if n not in known]
    missing = _missing_names(model, tensors.keys(), known)
    if tensors and not unknown and not missing:
        return tensors
    from transformers import AutoModelForCausalLM

    logger.info(
        "checkpoint names do not match the live model (%d unknown, %d missing); loading via from_pretrained",
        len(unknown),
        len(missing),
    )
    fresh = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    return dict(fresh.state_dict())


def _read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(f))
    return tensors
