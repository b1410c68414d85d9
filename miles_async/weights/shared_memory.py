"""The shared-memory route: SGLang on the trainer's node loads the tensors from the trainer's memory
(``/update_weights_from_tensor``); only handles travel over HTTP.

SGLang takes the tensors pickled with torch's multiprocessing reductions: CUDA IPC handles for GPU tensors
(the colocated route of Miles and slime), shared-memory files for CPU tensors. For the CPU the file-system
sharing strategy is used while pickling: torch's default, file descriptors, hands them over through a socket
back to this process that only a child of it may use (an unrelated server is refused: "digest sent was
rejected"). Each bucket is copied once into shared memory, for every engine, and kept alive until they have
all loaded it.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterable

import torch

from miles_async.inference.client import EngineClient
from miles_async.weights.http import Bucket, stream_buckets


def shared_memory_pickle(named_tensors: Bucket) -> tuple[str, list[torch.Tensor]]:
    """(base64 of the pickled (name, tensor) list, the shared tensors to keep alive until the engine loaded them)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    shared: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors:
        t = t.detach()
        if t.device.type == "cpu":
            buf = torch.empty(t.shape, dtype=t.dtype).share_memory_()
            buf.copy_(t)
            t = buf
        shared.append((name, t))
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        out = io.BytesIO()
        ForkingPickler(out, 4).dump(shared)
    finally:
        mp.set_sharing_strategy(before)
    return base64.b64encode(out.getvalue()).decode(), [t for _, t in shared]


async def _post_handles(clients: list[EngineClient], bucket: Bucket, version: int | None, flush: bool) -> None:
    payload, keep_alive = await asyncio.to_thread(shared_memory_pickle, bucket)
    await asyncio.gather(*[c.update_weights_from_serialized(payload, version, flush=flush) for c in clients])
    del keep_alive  # loaded everywhere: the shared files may go


async def push_buckets(
    buckets: Iterable[Bucket], urls: list[str], weight_version: int, timeout: float, engine: str = "sglang"
) -> int:
    """Hand each bucket to every engine as shared-memory handles; returns the bytes sent per engine."""
    return await stream_buckets(buckets, urls, weight_version, timeout, engine, _post_handles)
