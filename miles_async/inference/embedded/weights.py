"""The embedded engine's weights: HF-named tensors copied into the live model, checkpoints read from disk, and
updates staged in the trainer's shared memory (``ShmMaps``, ``map_staged``: mapped and checked while the engine
generates, copied in by the engine's commit).

Names are HF parameter names (``model.state_dict()`` keys); for tied embeddings either or both of
``lm_head.weight`` and ``model.embed_tokens.weight`` may be given. An MoE model's routed experts may also be
named as its checkpoint names them (``checkpoint_aliases``), and so may any parameter transformers renamed on load
(``renamed_aliases``): that is how the trainers stream them.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from miles_async.inference.embedded.records import UnknownParameterError

logger = logging.getLogger(__name__)


def param_table(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, every alias of a tied weight and every checkpoint name of a fused
    expert parameter included."""
    # remove_duplicate=False keeps every alias of tied weights, so both
    # lm_head.weight and model.embed_tokens.weight resolve.
    table = dict(model.named_parameters(remove_duplicate=False))
    for name, buf in model.named_buffers(remove_duplicate=False):
        table.setdefault(name, buf)
    return {**checkpoint_aliases(model, table), **renamed_aliases(model, table), **table}


def renamed_aliases(model: torch.nn.Module, table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter that transformers renamed on load (a vision-language model's ``model.language_model.*`` is
    ``model.*`` in its checkpoint, its ``model.visual.*`` is ``visual.*``) under its checkpoint name too: the name
    the trainers stream (``utils.hf_names``). Only pure renames: transformers' inverse of a fused tensor makes
    copies, which a weight update could not write through (``checkpoint_aliases`` gives those as views)."""
    from miles_async.utils.hf_names import checkpoint_named

    return {
        alias: t
        for name, t in table.items()
        for alias, same in checkpoint_named(model, [(name, t)])
        if alias != name and same.data_ptr() == t.data_ptr() and same.shape == t.shape
    }


_FUSED_EXPERTS = re.compile(r"^(.*)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$")


def checkpoint_aliases(model: torch.nn.Module, table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps an MoE layer's routed experts as two fused parameters (``experts.gate_up_proj``
    ``[experts, 2 x ffn, hidden]``, ``experts.down_proj`` ``[experts, hidden, ffn]``), while its checkpoints (and
    SGLang, vLLM and the trainers' weight streams) name each expert's projections: ``mlp.experts.<e>.gate_proj``
    / ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2`` and
    ``block_sparse_moe.gate``. Each such name, as a view into the fused parameter."""
    mixtral = getattr(getattr(model, "config", None), "model_type", None) == "mixtral"
    block, (g, u, d) = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in table.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            continue
        pre = f"{m.group(1)}.{block}."
        if m.group(3) is None:
            if mixtral:
                out[pre + "gate.weight"] = t
        elif m.group(3) == "down_proj":
            out.update({f"{pre}experts.{e}.{d}.weight": t[e] for e in range(t.shape[0])})
        else:
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}experts.{e}.{g}.weight"] = t[e, :f]
                out[f"{pre}experts.{e}.{u}.weight"] = t[e, f:]
    return out


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


SHM_DIR = "/dev/shm"
_PROC_FD = re.compile(r"/proc/\d+/fd/\d+")
_MEMFD_PREFIX = "/memfd:miles-async-wstage-"  # the trainer's names (miles_async/weights/staging.py)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StagedWeights:
    """A weight update the trainer wrote into shared memory, mapped here and checked against the model but
    not yet applied: ``tensors`` are views of the mappings (``ShmMaps``), copied into the parameters by
    ``copy_into_model`` once the engine is paused."""

    weight_version: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class ShmMaps:
    """The trainer's staging files, mapped read-only and kept from one update to the next: the trainer reuses
    its files, so the next update finds them mapped (mapping and populating a file costs about as much as the
    copy itself). Only the trainer's memfds (``/proc/<pid>/fd/<fd>``, named ``miles-async-wstage-*``) and files
    directly in ``shm_dir`` are opened. A mapping outlives the trainer's closing of its file until
    ``keep_only`` or ``clear`` drops it."""

    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = os.path.realpath(shm_dir)
        self._maps: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}

    def get(self, path: str) -> torch.Tensor:
        """The file's bytes as a uint8 tensor (mapped now, or earlier if it is the same file)."""
        if _PROC_FD.fullmatch(path):
            real = path
            try:
                target = os.readlink(path)
            except OSError as e:
                raise ValueError(f"{path!r}: {e.strerror} (is the trainer on this node and still running?)") from e
            if not target.startswith(_MEMFD_PREFIX):
                raise ValueError(f"{path!r} is not a weight staging memfd ({target!r})")
        else:
            real = os.path.realpath(path)
            if os.path.dirname(real) != self.shm_dir:
                raise ValueError(f"{path!r} is not a file in {self.shm_dir}")
        fd = os.open(real, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino, st.st_size)
            cached = self._maps.get(real)
            if cached is not None and cached[0] == key:
                return cached[1]
            # MAP_POPULATE: the page tables are filled now, while generation goes on, not during the copy.
            m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: the engine only reads it
            data = torch.frombuffer(m, dtype=torch.uint8)
        self._maps[real] = (key, data)
        return data

    def _drop(self, path: str) -> None:
        # Not mmap.close(): it would unmap under a tensor still viewing it (a staged update being copied);
        # the mapping goes when its last view does (torch.frombuffer holds the mmap).
        self._maps.pop(path, None)

    def keep_only(self, paths: Iterable[str]) -> None:
        # As ``get`` names them: a memfd's /proc path as it is (its realpath is "/memfd:... (deleted)").
        keep = {p if _PROC_FD.fullmatch(p) else os.path.realpath(p) for p in paths}
        for p in [p for p in self._maps if p not in keep]:
            self._drop(p)

    def clear(self) -> None:
        self.keep_only(())


def _segment_error(i: int, message: str) -> ValueError:
    return ValueError(f"segments[{i}]: {message}")


def _well_formed(entry: Any) -> bool:
    """``[name, dtype, shape, offset]`` of the types the checks below can compare (a caller's JSON)."""
    if not isinstance(entry, list) or len(entry) != 4:
        return False
    name, dtype, shape, _ = entry
    shape_ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    return isinstance(name, str) and isinstance(dtype, str) and shape_ok


def map_staged(model: torch.nn.Module, segments: Any, weight_version: int, maps: ShmMaps) -> StagedWeights:
    """View each tensor of the trainer's staging files in place (mapped through ``maps``); every name, shape,
    dtype and byte range is checked before anything is kept."""
    if not isinstance(segments, list) or not segments:
        raise ValueError("segments: expected a non-empty list of {path, tensors}")
    table = param_table(model)
    staged = StagedWeights(int(weight_version), {})
    for i, seg in enumerate(segments):
        well_formed = isinstance(seg, dict) and isinstance(seg.get("path"), str)
        if not well_formed or not isinstance(seg.get("tensors"), list):
            raise _segment_error(i, "expected {path: str, tensors: [[name, dtype, shape, offset], ...]}")
        try:
            data = maps.get(seg["path"])
        except ValueError as e:
            raise _segment_error(i, str(e)) from e
        size = data.numel()
        for entry in seg["tensors"]:
            if not _well_formed(entry):
                raise _segment_error(
                    i, f"tensor {str(entry)[:80]}: expected [name: str, dtype: str, shape: [int], offset]"
                )
            name, dtype, shape, offset = entry
            if name not in table:
                raise UnknownParameterError([name])
            if dtype not in _DTYPES:
                raise _segment_error(i, f"{name}: dtype {dtype!r}, expected one of {sorted(_DTYPES)}")
            dt = _DTYPES[dtype]
            if tuple(shape) != tuple(table[name].shape):
                raise ValueError(f"shape mismatch: {name}: got {tuple(shape)}, expected {tuple(table[name].shape)}")
            n = table[name].numel() * dt.itemsize
            if not isinstance(offset, int) or offset < 0 or offset + n > size or offset % dt.itemsize:
                raise _segment_error(i, f"{name}: bytes [{offset}, +{n}) outside the {size}-byte file")
            staged.tensors[name] = data[offset : offset + n].view(dt).view(tuple(shape))
    maps.keep_only(seg["path"] for seg in segments)
    return staged


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
