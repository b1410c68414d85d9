"""The same-node route (``--weight-update-method tensor`` into an engine on the trainer's node): the engine loads
the tensors from the trainer's memory; only handles or offsets travel over HTTP. Two engines, two forms:

- The embedded engine maps a staging buffer (``staging.py``): each bucket is written once into a /dev/shm
  file, the engine maps and checks it (``/stage_weights_from_shm``, possible while it generates: the driver
  stages before pausing, ``driver.py``) and copies it into its parameters on ``/commit_staged_weights`` (the
  driver's calls: ``staged.py``). An embedded engine on another node gets the staged bytes over HTTP instead
  (the http route).
- SGLang (``/update_weights_from_tensor``) takes torch multiprocessing handles, below.

SGLang takes the tensors pickled with torch's multiprocessing reductions, so the handle follows the bucket's
device: GPU tensors go as CUDA IPC handles to the trainer's GPU memory, uncopied (the colocated route of
Miles and slime), CPU tensors as shared-memory files. Either is memory of this node, so an engine on
another node is refused before anything is sent.

- CUDA: the GPU is named by its UUID rather than this process's index for it, because the engine numbers
  its visible GPUs by its own ``CUDA_VISIBLE_DEVICES``; SGLang's rebuild (``monkey_patch_torch_reductions``)
  takes either. Torch counts the consumers of a CUDA handle per pickling, so every TP rank of every engine
  gets a pickle of its own (SGLang's ranks each load their entry of ``serialized_named_tensors``).
- CPU: the file-system sharing strategy is used while pickling: torch's default, file descriptors, hands
  them over through a socket back to this process that only a child of it may use (an unrelated server is
  refused: "digest sent was rejected"). Each bucket is copied once into shared memory, for every engine.

Either way the bucket is kept alive until every engine has loaded it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from collections.abc import Iterable

import torch

from miles_async.inference.client import EngineClient
from miles_async.utils.api_key import ApiKey
from miles_async.weights import http
from miles_async.weights.http import Bucket, stream_buckets
from miles_async.weights.node import node_address, on_this_node
from miles_async.weights.staged import commit, discard, each_engine
from miles_async.weights.staging import StagingBuffer

logger = logging.getLogger(__name__)

_DEVICE_ARG = 6  # the GPU index in torch's reduce_tensor arguments for rebuild_cuda_tensor


def share(bucket: Bucket) -> Bucket:
    """The bucket as engines map it: GPU tensors as they are, CPU tensors copied into shared memory."""
    shared: Bucket = []
    for name, t in bucket:
        t = t.detach()
        if t.device.type == "cpu":
            buf = torch.empty(t.shape, dtype=t.dtype).share_memory_()
            buf.copy_(t)
            t = buf
        shared.append((name, t))
    return shared


def _reduce_naming_the_gpu(t: torch.Tensor):
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if rebuild is reductions.rebuild_cuda_tensor:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def pickle_handles(shared: Bucket) -> str:
    """Base64 of the pickled (name, tensor) list of a ``share``d bucket, for one engine rank."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        out = io.BytesIO()
        pickler = ForkingPickler(out, 4)
        pickler.dispatch_table[torch.Tensor] = _reduce_naming_the_gpu
        pickler.dump(shared)
    finally:
        mp.set_sharing_strategy(before)
    return base64.b64encode(out.getvalue()).decode()


def refuse_other_nodes(urls: list[str]) -> None:
    """Handles to this node's memory mean nothing on another node: say so, before the update starts."""
    elsewhere = [u for u in urls if not on_this_node(u)]
    if elsewhere:
        raise ValueError(
            f"--weight-update-method tensor hands SGLang handles to the trainer's memory (CUDA IPC handles, "
            f"shared-memory files), which only an engine on the trainer's node ({node_address()}) can open; "
            f"the engines at {elsewhere} run on another node: use --weight-update-method distributed (or disk)"
        )


async def _post_handles(clients: list[EngineClient], bucket: Bucket, version: int | None, flush: bool) -> None:
    # ``shared`` lives until every engine has loaded it (then its shared files may go).
    shared = await asyncio.to_thread(share, bucket)

    async def post(c: EngineClient) -> None:
        payloads = [pickle_handles(shared) for _ in range(await c.tp_size())]
        await c.update_weights_from_serialized(payloads, version, flush=flush)

    await asyncio.gather(*[post(c) for c in clients])


async def push_buckets(
    buckets: Iterable[Bucket],
    urls: list[str],
    weight_version: int,
    timeout: float,
    engine: str = "sglang",
    flush: bool = True,
    api_key: ApiKey | None = None,
) -> int:
    """Hand each bucket to every engine as handles to this node's memory; returns the bytes sent per engine."""
    refuse_other_nodes(urls)
    return await stream_buckets(buckets, urls, weight_version, timeout, engine, _post_handles, flush, api_key)


# -- the embedded engine: a staging buffer it maps ---------------------------------------------------------


async def stage(
    buckets: Iterable[Bucket],
    urls: list[str],
    weight_version: int,
    timeout: float,
    engine: str,
    staging: StagingBuffer,
    api_key: ApiKey | None = None,
) -> tuple[int, list[dict], list[str]]:
    """Write every bucket once into ``staging`` and have each engine of ``urls`` on this node map it, without
    applying it (they may be generating). Returns (bytes, the segments, the engines staged); the engines on
    other nodes are left out (they cannot map this node's memory)."""
    near = [u for u in urls if on_this_node(u)]
    segments, nbytes = await asyncio.to_thread(staging.write, buckets)
    try:
        await each_engine(near, timeout, engine, api_key, lambda c: c.stage_weights_from_shm(segments, weight_version))
    except BaseException:
        await discard(near, timeout, engine, api_key)
        raise
    return nbytes, segments, near


async def push_staged(
    buckets: Iterable[Bucket],
    urls: list[str],
    weight_version: int,
    timeout: float,
    engine: str,
    staging: StagingBuffer,
    flush: bool = True,
    api_key: ApiKey | None = None,
) -> int:
    """Stage and commit at once (the engines are paused); engines on other nodes get the bytes over HTTP."""
    nbytes, segments, near = await stage(buckets, urls, weight_version, timeout, engine, staging, api_key)
    await commit(near, weight_version, timeout, engine, flush, api_key)
    far = [u for u in urls if u not in near]
    if far:
        logger.info("engines %s are on another node than the trainer: their weights go over HTTP", far)
        await http.push_buckets(staging.buckets(segments), far, weight_version, timeout, engine, flush, api_key)
    return nbytes
