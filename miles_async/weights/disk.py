"""The disk route: the trainer's rank 0 writes an HF folder (safetensors shards and config.json) in the
engines' dtype, which the engines then load (SGLang's ``/update_weights_from_disk``, vLLM's
``reload_weights``); the driver brings the folder to them and removes it. ``save_hf_folder`` also writes
``--save-hf`` checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from miles_async.weights.update import WeightUpdate

# Files of an HF folder that are not weights; an engine reloading weights needs none of them but the config.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin")


def save_hf_folder(
    named: Iterable[tuple[str, torch.Tensor]],
    src: str | Path,
    out: str | Path,
    max_shard_bytes: int = 2 << 30,
    dtype: torch.dtype | None = None,
    side_files: str = "all",
) -> int:
    """Write streamed HF-named tensors (cast to ``dtype`` if given) as safetensors shards, plus the source
    folder's other files: ``side_files`` "all" (config, tokenizer, ...: a loadable checkpoint) or "config"
    (config.json only: what an engine reloading weights reads). Returns the bytes of tensors written."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush():
        nonlocal shard, size
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for name, t in named:
        c = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        if c.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            # No cast happened, so this is the live parameter: copy it (safetensors also refuses tensors that
            # share storage, as tied embeddings do).
            c = c.clone()
        nbytes = c.numel() * c.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = c
        size += nbytes
        total += nbytes
    if shard:
        flush()
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
    else:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if not f.is_file() or f.name.endswith(WEIGHT_FILE_SUFFIXES) or f.name == "model.safetensors.index.json":
            continue
        if side_files == "all" or f.name == "config.json":
            shutil.copy2(f, out / f.name)
    return total


def write_hf_checkpoint(named: Iterable[tuple[str, torch.Tensor]], model_path: str, path: str | Path) -> None:
    """--save-hf: an HF folder of ``named`` with ``model_path``'s config and tokenizer at ``path``, written
    beside it first and renamed into place, so ``path`` is always a whole checkpoint."""
    tmp = Path(str(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_folder(named, model_path, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def write_engine_folder(named: Iterable[tuple[str, torch.Tensor]], model_path: str, update: WeightUpdate) -> int:
    """The update's folder: the weights in the engines' dtype and the model's config.json (what an engine
    reloading weights reads; no tokenizer). Returns the bytes of tensors written."""
    return save_hf_folder(named, model_path, update.folder, dtype=update.torch_dtype, side_files="config")
