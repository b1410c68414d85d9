"""The http route: each bucket posted to every engine through its client (the embedded engine: the bytes as
a safetensors blob); the version is set with the last bucket, so it flips once every bucket has landed and a
repeated push is harmless. ``stream_buckets`` is that loop, shared with the shared-memory route."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import torch

from miles_async.inference.client import EngineClient
from miles_async.inference.engines import make_client
from miles_async.utils.api_key import ApiKey
from miles_async.weights.source import bucket_bytes

Bucket = list[tuple[str, torch.Tensor]]
# send(clients, bucket, weight_version on the last bucket else None, flush)
SendBucket = Callable[[list[EngineClient], Bucket, "int | None", bool], Awaitable[None]]


async def stream_buckets(
    buckets: Iterable[Bucket],
    urls: list[str],
    weight_version: int,
    timeout: float,
    engine: str,
    send: SendBucket,
    flush: bool = True,
    api_key: ApiKey | None = None,
) -> int:
    """Bracket the buckets with each engine's begin/end of an update; returns the bytes sent per engine.
    ``flush``: the engines flush their prefix cache with the last bucket (``WeightUpdate.flush_cache``);
    ``api_key``: the engines' key (``WeightUpdate.api_key``)."""
    clients = [make_client(engine, u, timeout, api_key) for u in urls]
    buckets = iter(buckets)
    sent = 0
    try:
        await asyncio.gather(*[c.begin_weight_update() for c in clients])
        current = next(buckets, None)
        while current is not None:
            following = next(buckets, None)
            last = following is None
            await send(clients, current, weight_version if last else None, last and flush)
            sent += bucket_bytes(current)
            current = following
        await asyncio.gather(*[c.end_weight_update() for c in clients])
    finally:
        for c in clients:
            await c.close()
    return sent


async def _post_tensors(clients: list[EngineClient], bucket: Bucket, version: int | None, flush: bool) -> None:
    await asyncio.gather(*[c.update_weights_from_tensors(bucket, version, flush=flush) for c in clients])


async def push_buckets(
    buckets: Iterable[Bucket],
    urls: list[str],
    weight_version: int,
    timeout: float,
    engine: str = "embedded",
    flush: bool = True,
    api_key: ApiKey | None = None,
) -> int:
    """Send each bucket to every engine over HTTP; returns the bytes sent per engine."""
    return await stream_buckets(buckets, urls, weight_version, timeout, engine, _post_tensors, flush, api_key)
