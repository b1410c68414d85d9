"""Weights as a stream of (name, tensor) buckets, so an update never holds a second full copy."""

from __future__ import annotations

import asyncio
from typing import Iterable, Iterator

import torch

from miles_async.inference.client import make_client


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
