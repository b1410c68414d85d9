"""The trainer's rank 0 pushes an update's buckets by its route (the disk route writes instead: ``disk.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch

from miles_async.weights import http, shared_memory
from miles_async.weights.process_group import ProcessGroupRoute
from miles_async.weights.update import HTTP, PROCESS_GROUP, SHARED_MEMORY, WeightUpdate


class WeightSender:
    """One per trainer rank, for the run: holds the process-group route's group between updates."""

    def __init__(self):
        self._process_group = ProcessGroupRoute()

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], update: WeightUpdate) -> dict:
        t0 = time.time()
        targets = list(update.targets)
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

    def close(self) -> None:
        self._process_group.close()
