"""Weights as a stream of (name, tensor) buckets, so an update never holds a second full copy."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from miles_async.inference.client import make_client

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --rollout-dtype


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors (cast to the engine's dtype, on the CPU) into buckets of about ``bucket_bytes``."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach().to(device="cpu", dtype=dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


async def push_buckets(buckets: Iterator[list[tuple[str, torch.Tensor]]], urls: list[str], weight_version: int,
                       timeout: float, backend: str = "embedded") -> int:
    """Send each bucket to every engine (the client of ``backend``); the version is set with the last bucket.
    Returns bytes sent per engine."""
    clients = [make_client(backend, u, timeout) for u in urls]
    sent = 0
    try:
        await asyncio.gather(*[c.begin_weight_update() for c in clients])
        current = next(buckets, None)
        while current is not None:
            following = next(buckets, None)
            last = following is None
            await asyncio.gather(*[c.update_weights_from_tensors(current, weight_version if last else None,
                                                                 flush=last) for c in clients])
            sent += sum(t.numel() * t.element_size() for _, t in current)
            current = following
        await asyncio.gather(*[c.end_weight_update() for c in clients])
    finally:
        for c in clients:
            await c.close()
    return sent


# Files of an HF folder that are not weights; an engine reloading weights needs none of them but the config.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin")


def save_hf_folder(named: Iterable[tuple[str, torch.Tensor]], src: str | Path, out: str | Path,
                   max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None,
                   side_files: str = "all") -> int:
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
