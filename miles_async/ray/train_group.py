"""A group of training workers (Ray actors) driven as one model: the policy or the critic."""

from __future__ import annotations

import asyncio
import os

import ray

from miles_async.config import ClusterConfig, TrainConfig
from miles_async.ray.cluster import actor_options
from miles_async.ray.placement import GroupPlacement, where
from miles_async.utils.plugins import PluginError, load_function
from miles_async.weights.update import WeightUpdate

# ``module:Class`` of a policy worker to run instead of the backend's own: the plugin point for trainer doubles
# (benchmarks/train_doubles.py gives training a set cost), as $MILES_ASYNC_ENGINE_CLASS is for the engine.
ACTOR_CLASS_ENV = "MILES_ASYNC_ACTOR_CLASS"


def _backend_class(cfg: TrainConfig) -> type:
    if cfg.backend == "megatron" and cfg.role == "actor":
        from miles_async.backends.megatron.actor import MegatronTrainActor

        return MegatronTrainActor
    if cfg.backend != "fsdp":
        raise ValueError(f"--train-backend {cfg.backend} has no {cfg.role} worker")
    if cfg.role == "critic":
        from miles_async.backends.fsdp.critic import FSDPCritic

        return FSDPCritic
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    return FSDPTrainActor


def worker_class(cfg: TrainConfig) -> type:
    """The worker class of ``cfg``'s role and backend; for the actor, ``$MILES_ASYNC_ACTOR_CLASS`` when set
    (a subclass of the backend's own)."""
    cls = _backend_class(cfg)
    path = os.environ.get(ACTOR_CLASS_ENV)
    if cfg.role != "actor" or not path:
        return cls
    double = load_function(path, f"${ACTOR_CLASS_ENV}")
    if not (isinstance(double, type) and issubclass(double, cls)):
        raise PluginError(
            f"${ACTOR_CLASS_ENV}: {path!r} is not a subclass of {cls.__module__}.{cls.__qualname__} "
            f"(--train-backend {cfg.backend})"
        )
    return double


class TrainGroup:
    def __init__(
        self,
        cfg: TrainConfig,
        cluster: ClusterConfig,
        num_workers: int,
        total_optimizer_steps: int,
        load_dir: str | None,
        load_rollout_id: int | None,
        placement: GroupPlacement | None = None,
    ):
        """``placement``: the group's placement group (a cluster with GPUs): rank ``i`` on its ``i``-th bundle, with
        that bundle's GPU; without, CPU workers wherever Ray starts them."""
        remote_cls = ray.remote(worker_class(cfg))
        opts = actor_options(num_threads=cfg.num_threads)
        self.actors = [
            remote_cls.options(**opts, **(placement.options(rank) if placement else {})).remote(
                cfg, rank, num_workers, total_optimizer_steps, load_dir, load_rollout_id
            )
            for rank in range(num_workers)
        ]

    async def init(self) -> None:
        addr, port = await self.actors[0].address.remote()
        await asyncio.gather(*[a.init_process_group.remote(addr, port) for a in self.actors])

    async def _all(self, method: str, *args) -> list:
        return await asyncio.gather(*[getattr(a, method).remote(*args) for a in self.actors])

    async def call(self, method: str, *args):
        """Run ``method`` on every worker (each resolves the same object-store batch); rank 0's result."""
        return (await self._all(method, *args))[0]

    async def train(self, rollout_id: int, data_ref: ray.ObjectRef, *args) -> dict:
        return await self.call("train", rollout_id, data_ref, *args)

    async def push_weights(self, update: WeightUpdate) -> dict:
        return await self.call("push_weights", update)

    async def save(self, save_dir: str, rollout_id: int, save_optimizer: bool) -> None:
        await self._all("save", save_dir, rollout_id, save_optimizer)

    async def save_hf(self, path: str) -> None:
        await self._all("save_hf", path)

    async def pids(self) -> list[int]:
        return await self._all("pid")

    async def placement(self, role: str) -> list[dict]:
        """Where each rank runs (``placement.where``), asked of the worker itself whatever its backend."""
        return await asyncio.gather(
            *[a.__ray_call__.remote(lambda _self, r=rank: where(role, r)) for rank, a in enumerate(self.actors)]
        )

    def dispose(self) -> None:
        for a in self.actors:
            ray.kill(a)
