"""The trainer's rank 0 pushes an update's buckets by its route (the disk route writes instead: ``disk.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch

from miles_async.weights import http, shared_memory, staged
from miles_async.weights.process_group import ProcessGroupRoute
from miles_async.weights.staging import StagingBuffer
from miles_async.weights.update import HTTP, PROCESS_GROUP, SHARED_MEMORY, WeightUpdate


class WeightSender:
    """One per trainer rank, for the run: holds the process-group route's group and the shared-memory route's
    staging buffer between updates."""

    def __init__(self):
        self._process_group = ProcessGroupRoute()
        self._staging = StagingBuffer()

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], update: WeightUpdate) -> dict:
        t0 = time.time()
        targets = list(update.targets)
        if update.route == SHARED_MEMORY and staged.stages(update.engine):
            return self._push_staged(buckets, update, targets, t0)
        if update.stage_only:
            raise ValueError(f"weight route {update.route!r} into {update.engine} does not stage")
        if update.route == HTTP:
            nbytes = asyncio.run(
                http.push_buckets(
                    buckets, targets, update.version, update.timeout, update.engine, update.flush_cache, update.api_key
                )
            )
        elif update.route == SHARED_MEMORY:
            nbytes = asyncio.run(
                shared_memory.push_buckets(
                    buckets, targets, update.version, update.timeout, update.engine, update.flush_cache, update.api_key
                )
            )
        elif update.route == PROCESS_GROUP:
            nbytes = self._process_group.push(buckets, update)
        else:
            raise ValueError(f"weight route {update.route!r} does not push buckets")
        return {"weights/push_seconds": time.time() - t0, "weights/bytes": nbytes}

    def _push_staged(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], update: WeightUpdate, targets: list[str], t0: float
    ) -> dict:
        args = (targets, update.version, update.timeout, update.engine, self._staging)
        try:
            if update.stage_only:
                nbytes, _, staged = asyncio.run(shared_memory.stage(buckets, *args, update.api_key))
                return {"weights/stage_seconds": time.time() - t0, "weights/bytes": nbytes, "staged_urls": staged}
            nbytes = asyncio.run(shared_memory.push_staged(buckets, *args, update.flush_cache, update.api_key))
        except BaseException:
            self._staging.close()  # a failed update leaves no files behind
            raise
        return {"weights/push_seconds": time.time() - t0, "weights/bytes": nbytes}

    def close(self) -> None:
        self._process_group.close()
        self._staging.close()
