"""A group of training workers (Ray actors) driven as one model."""

from __future__ import annotations

import asyncio

import ray

from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.config import ClusterConfig, TrainConfig
from miles_async.ray.cluster import actor_options


class TrainGroup:
    def __init__(self, cfg: TrainConfig, cluster: ClusterConfig, total_optimizer_steps: int,
                 load_dir: str | None, load_rollout_id: int | None):
        if cfg.backend != "fsdp":
            raise ValueError(f"--train-backend {cfg.backend} is not available")
        remote_cls = ray.remote(FSDPTrainActor)
        world = cluster.num_train_workers
        opts = actor_options(cluster, num_threads=cfg.num_threads, gpu=True)
        self.actors = [remote_cls.options(**opts).remote(cfg, rank, world, total_optimizer_steps, load_dir,
                                                         load_rollout_id)
                       for rank in range(world)]

    async def init(self) -> None:
        addr, port = await self.actors[0].address.remote()
        await asyncio.gather(*[a.init_process_group.remote(addr, port) for a in self.actors])

    async def _all(self, method: str, *args) -> list:
        return await asyncio.gather(*[getattr(a, method).remote(*args) for a in self.actors])

    async def train(self, rollout_id: int, data_ref: ray.ObjectRef, temperature: float) -> dict:
        # Each worker resolves the same object-store batch; only rank 0's metrics are kept.
        return (await self._all("train", rollout_id, data_ref, temperature))[0]

    async def push_weights(self, urls: list[str], weight_version: int, engine_dtype: str, timeout: float) -> dict:
        return (await self._all("push_weights", urls, weight_version, engine_dtype, timeout))[0]

    async def save(self, save_dir: str, rollout_id: int, save_optimizer: bool) -> None:
        await self._all("save", save_dir, rollout_id, save_optimizer)

    async def save_hf(self, path: str) -> None:
        await self._all("save_hf", path)

    async def pids(self) -> list[int]:
        return await self._all("pid")

    def dispose(self) -> None:
        for a in self.actors:
            ray.kill(a)
