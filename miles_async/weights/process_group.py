"""The process-group route (``--weight-update-method distributed``) into SGLang: one process group of the
trainer's rank 0 and every engine's tensor-parallel ranks, the weights broadcast from rank 0 in buckets
(``update_weights_from_distributed``).

On GPUs the group is NCCL (the route Miles and slime use between the trainer and non-colocated engines) and
the buckets are broadcast from the trainer's GPU memory, with no stop on the CPU; on the CPU the same calls
run over gloo, which is how the suite drives this route against SGLang's real CPU server: the only line that
differs on a GPU is the backend name (scripts/gpu/check_sglang_nccl.sh).

Protocol, per SGLang's HTTP API:
1. ``/init_weights_update_group`` on every engine (``rank_offset`` 1 + i * tp, ``world_size`` 1 + n * tp),
   while this process, rank 0, hosts the rendezvous store and joins. The group is not the default one: the
   trainer keeps its own (DDP / Megatron) default group, so it is built the way SGLang builds its side
   (a TCP store, prefixed with the group name, then torch's group constructor), or the two sides would
   look for each other under different keys.
2. ``/begin_weight_update``, then per bucket ``/update_weights_from_distributed`` with the names, dtypes and
   shapes on every engine while rank 0 broadcasts the bucket's tensors in that order; the last bucket carries
   the weight version and flushes the engines' caches; then ``/end_weight_update``.

Waits race failures: joining and every broadcast run against the engines' HTTP answers, and an engine that
answers with an error fails the update at once instead of leaving rank 0 waiting in a collective.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable
from datetime import timedelta
from urllib.parse import urlparse

import requests
import torch

from miles_async.inference.auth import auth_headers
from miles_async.utils.api_key import ApiKey
from miles_async.utils.ports import hosted_store
from miles_async.weights.node import LOOPBACK, node_address
from miles_async.weights.update import WeightUpdate

logger = logging.getLogger(__name__)

GROUP_NAME = "miles_async_weights"


class WeightGroupError(RuntimeError):
    pass


def _join_as_rank0(store: torch.distributed.TCPStore, world_size: int, backend: str, timeout: float):
    """Join the group as rank 0 through ``store``, keyed as SGLang's ``init_custom_process_group`` keys its side
    (the group name as the store prefix and as the group's name)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    pg, _ = _new_process_group_helper(
        world_size,
        0,
        [],
        Backend(backend),
        PrefixStore(GROUP_NAME, store),
        group_name=GROUP_NAME,
        timeout=timedelta(seconds=timeout),
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg, store


class EngineWeightGroup:
    """Trainer rank 0's end of the group; ``connect`` once, ``push`` every update, ``close`` at the end."""

    def __init__(
        self,
        urls: list[str],
        ranks_per_engine: int,
        backend: str,
        master_address: str,
        timeout: float = 300.0,
        api_key: ApiKey | None = None,
    ):
        self.urls = list(urls)
        self._headers = auth_headers(api_key)
        self.ranks_per_engine = ranks_per_engine
        self.backend = backend
        self.master_address = master_address
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.pg = None
        self._store = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max(2, len(self.urls) + 1))

    def _post_all(self, endpoint: str, bodies: list[dict]) -> dict[str, concurrent.futures.Future]:
        return {
            url: self._pool.submit(
                requests.post, url + endpoint, json=body, headers=self._headers, timeout=self.timeout
            )
            for url, body in zip(self.urls, bodies)
        }

    def _check(self, url: str, fut: concurrent.futures.Future, endpoint: str) -> None:
        try:
            r = fut.result(timeout=self.timeout)
        except Exception as e:
            raise WeightGroupError(f"{url}{endpoint} failed: {e!r}") from e
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code == 401:
            what = "the API key it was sent was refused" if self._headers else "no API key was sent"
            raise WeightGroupError(f"{url}{endpoint} answered 401: the engine requires an API key and {what}")
        if r.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise WeightGroupError(f"{url}{endpoint} answered {r.status_code}: {r.text[:1000]}")

    def _race(self, work: concurrent.futures.Future, answers: dict[str, concurrent.futures.Future], endpoint: str):
        """Wait for ``work`` (this process's part) and then the engines' answers, failing at once if an engine
        answers with an error while rank 0 still waits in the collective."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                result = work.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                pass
            for url, fut in answers.items():
                if fut.done():
                    self._check(url, fut, endpoint)  # raises on an error answer
            if time.monotonic() > deadline:
                raise WeightGroupError(f"{endpoint}: rank 0 still waiting in the collective after {self.timeout:.0f}s")
        for url, fut in answers.items():
            self._check(url, fut, endpoint)
        return result

    def connect(self) -> None:
        world = 1 + len(self.urls) * self.ranks_per_engine
        # On a port the kernel picked, so no other process can take it before the engines are told it.
        store = hosted_store(self.master_address, self.timeout, world)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": store.port,
                "rank_offset": 1 + i * self.ranks_per_engine,
                "world_size": world,
                "group_name": GROUP_NAME,
                "backend": self.backend,
            }
            for i in range(len(self.urls))
        ]
        t0 = time.perf_counter()
        answers = self._post_all("/init_weights_update_group", bodies)
        join = self._pool.submit(_join_as_rank0, store, world, self.backend, self.timeout)
        self.pg, self._store = self._race(join, answers, "/init_weights_update_group")
        logger.info(
            "weight group %s: %d ranks over %s in %.1fs", GROUP_NAME, world, self.backend, time.perf_counter() - t0
        )

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], weight_version: int, flush: bool = True) -> int:
        """Broadcast every bucket; returns the bytes sent."""
        if self.pg is None:
            self.connect()
        self._call_all("/begin_weight_update")  # SGLang unpacks its kernel-packed weights so new ones can load
        sent = 0
        buckets = iter(buckets)
        current = next(buckets, None)
        while current is not None:
            following = next(buckets, None)
            last = following is None
            body = {
                "names": [n for n, _ in current],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in current],
                "shapes": [list(t.shape) for _, t in current],
                "group_name": GROUP_NAME,
                "flush_cache": last and flush,
            }
            if last:
                body["weight_version"] = str(int(weight_version))
            answers = self._post_all("/update_weights_from_distributed", [body] * len(self.urls))
            # On the group's device: a GPU bucket goes out as it is over NCCL (a CPU one is copied up), a GPU
            # bucket is copied down for gloo; a blocking copy, so gloo never reads a copy still in flight.
            tensors = [t.to(self.device).contiguous() for _, t in current]
            broadcast = self._pool.submit(self._broadcast, tensors)
            self._race(broadcast, answers, "/update_weights_from_distributed")
            sent += sum(t.numel() * t.element_size() for t in tensors)
            current = following
        self._call_all("/end_weight_update")  # ... and packs them again
        return sent

    def _call_all(self, endpoint: str, body: dict | None = None) -> None:
        for url, fut in self._post_all(endpoint, [body or {}] * len(self.urls)).items():
            self._check(url, fut, endpoint)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            torch.distributed.broadcast(t, src=0, group=self.pg)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self.pg is not None:
            try:
                self._call_all("/destroy_weights_update_group", {"group_name": GROUP_NAME})
            except Exception as e:  # noqa: BLE001 - closing must not hide the run's own outcome
                logger.warning("could not close the weight group: %s", e)
            torch.distributed.destroy_process_group(self.pg)
            self.pg = None
        self._pool.shutdown(wait=False)


def trainer_address(urls: list[str]) -> str:
    """Where the engines reach rank 0's rendezvous: loopback when they all run here, else this node's address."""
    if all(urlparse(u).hostname in LOOPBACK for u in urls):
        return "127.0.0.1"
    return node_address()


class ProcessGroupRoute:
    """The route's state on rank 0: the group joined at the first push and kept while the targets stay the
    same (a new group when they change, e.g. an engine left out under --use-fault-tolerance)."""

    def __init__(self):
        self.group: EngineWeightGroup | None = None

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], update: WeightUpdate) -> int:
        urls = list(update.targets)
        if self.group is not None and self.group.urls != urls:
            self.close()
        if self.group is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self.group = EngineWeightGroup(
                urls, update.ranks_per_engine, backend, trainer_address(urls), update.timeout, update.api_key
            )
        return self.group.push(buckets, update.version, update.flush_cache)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
