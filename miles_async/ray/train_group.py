"""A group of training workers (Ray actors) driven as one model: the policy or the critic.

A worker that dies is reported as ``TrainerDied`` (role, rank, pid, node) whatever the driver was awaiting: the
group's own calls turn a dead worker's failure, or a survivor's failure caused by it (a collective whose peer is
gone), into it, and ``watch`` notices a death while the driver awaits something else (a rollout, an eval).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from miles_async.config import ClusterConfig, TrainConfig
from miles_async.ray.cluster import actor_options
from miles_async.ray.placement import GroupPlacement, where
from miles_async.ray.trainer_recovery import TrainerDied
from miles_async.ray.worker_host import CHECKPOINT_GROUP, host_class
from miles_async.utils.plugins import PluginError, load_function, load_object
from miles_async.weights.update import WeightUpdate

# ``module:Class`` of a policy worker to run instead of the backend's own: the plugin point for trainer doubles
# (benchmarks/train_doubles.py gives training a set cost), as $MILES_ASYNC_ENGINE_CLASS is for the engine.
ACTOR_CLASS_ENV = "MILES_ASYNC_ACTOR_CLASS"

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds between two liveness pings of an idle worker; a busy one answers its ping after its current call, and a
# dead one fails it as soon as Ray knows, so a death is noticed within about this long of Ray noticing it.
WATCH_INTERVAL = 1.0
# After a failed group call, how long to wait for a worker death behind it (Ray reports the dead rank's own
# death shortly after a surviving rank's collective fails on the lost connection).
DEATH_GRACE = 10.0


# ``module:Class`` of each backend's worker for each role: named, not imported (``worker_host``).
_BACKEND_CLASSES = {
    ("megatron", "actor"): "miles_async.backends.megatron.actor:MegatronTrainActor",
    ("fsdp", "actor"): "miles_async.backends.fsdp.actor:FSDPTrainActor",
    ("fsdp", "critic"): "miles_async.backends.fsdp.critic:FSDPCritic",
}


def _backend_class_path(cfg: TrainConfig) -> str:
    path = _BACKEND_CLASSES.get((cfg.backend, cfg.role))
    if path is None:
        raise ValueError(f"--train-backend {cfg.backend} has no {cfg.role} worker")
    return path


def worker_class(cfg: TrainConfig) -> type:
    """The worker class of ``cfg``'s role and backend; for the actor, ``$MILES_ASYNC_ACTOR_CLASS`` when set
    (a subclass of the backend's own)."""
    cls = load_object(_backend_class_path(cfg), "training worker class")
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


def worker_class_path(cfg: TrainConfig) -> str:
    """``module:Class`` of ``worker_class(cfg)``: imported here only to check a ``$MILES_ASYNC_ACTOR_CLASS`` double
    (a test's or a benchmark's), so a run's driver never imports torch for its workers."""
    if cfg.role == "actor" and os.environ.get(ACTOR_CLASS_ENV):
        cls = worker_class(cfg)
        return f"{cls.__module__}:{cls.__qualname__}"
    return _backend_class_path(cfg)


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
        self.role = cfg.role
        self.workers: list[dict] = []  # each rank's placement.where(), once init() ran: names it when it dies
        self._watch: asyncio.Task | None = None
        # The checkpoint group: a background save is written on a thread of its own, beside the training calls.
        class_path = worker_class_path(cfg)
        remote_cls = ray.remote(concurrency_groups={CHECKPOINT_GROUP: 1})(host_class(class_path))
        opts = actor_options(num_threads=cfg.num_threads)
        self.actors = [
            remote_cls.options(**opts, **(placement.options(rank) if placement else {})).remote(
                class_path,
                cfg,
                rank,
                num_workers,
                total_optimizer_steps,
                load_dir,
                load_rollout_id,
                cpu_affinity=cfg.cpu_affinity,
            )
            for rank in range(num_workers)
        ]

    async def init(self) -> None:
        self.workers = await self.placement(self.role)
        self._watch = asyncio.ensure_future(self._watch_all())
        addr, port = await self._call(0, self.actors[0].run.remote("address"))
        await self._all("init_process_group", addr, port)

    # -- deaths ------------------------------------------------------------------------------------
    def _died(self, rank: int, error: BaseException) -> TrainerDied:
        w = self.workers[rank] if rank < len(self.workers) else {}
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return TrainerDied(self.role, rank, w.get("pid"), w.get("node_ip"), cause)

    async def _call(self, rank: int, ref: Awaitable[T]) -> T:
        try:
            return await ref
        except ActorDiedError as e:
            raise self._died(rank, e) from e

    async def _watch_all(self) -> None:
        async def one(rank: int, actor) -> None:
            while True:
                try:
                    await self._call(rank, actor.pid.remote())
                except ActorUnavailableError:  # unreachable for now (network); Ray says ActorDiedError once dead
                    pass
                await asyncio.sleep(WATCH_INTERVAL)

        await asyncio.gather(*[one(rank, a) for rank, a in enumerate(self.actors)])

    @property
    def watch(self) -> asyncio.Task | None:
        """Runs from ``init`` until ``dispose``; ends only by raising ``TrainerDied`` for the first worker that
        died. Race what the driver awaits against it (``race_deaths``)."""
        return self._watch

    async def death_behind(self, error: BaseException, grace: float = DEATH_GRACE) -> TrainerDied | None:
        """Something failed with ``error``: the death of one of this group's workers behind it, if any. Every
        worker is pinged: when all answer none died (at once, so an error that has nothing to do with the trainers
        is not held up); a worker that does not answer may be blocked in a collective with a dead one, and
        Ray reports that one within ``grace``."""
        if isinstance(error, TrainerDied) or self._watch is None:
            return error if isinstance(error, TrainerDied) else None
        pings = asyncio.ensure_future(
            asyncio.gather(*[self._call(rank, a.pid.remote()) for rank, a in enumerate(self.actors)])
        )
        try:
            done, _ = await asyncio.wait([self._watch, pings], timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pings.cancel()
            pings.add_done_callback(lambda t: t.cancelled() or t.exception())
        for t in (self._watch, pings):
            if t in done and not t.cancelled() and isinstance(t.exception(), TrainerDied):
                return t.exception()
        return None

    async def _all(self, method: str, *args) -> list:
        try:
            return await asyncio.gather(
                *[self._call(rank, a.run.remote(method, *args)) for rank, a in enumerate(self.actors)]
            )
        except Exception as e:
            death = await self.death_behind(e)
            if death is None or death is e:
                raise
            raise death from e

    async def call(self, method: str, *args):
        """Run ``method`` on every worker (each resolves the same object-store batch); rank 0's result."""
        return (await self._all(method, *args))[0]

    async def train(self, rollout_id: int, data_ref: ray.ObjectRef, *args) -> dict:
        return await self.call("train", rollout_id, data_ref, *args)

    async def push_weights(self, update: WeightUpdate) -> dict:
        return await self.call("push_weights", update)

    async def save(self, save_dir: str, rollout_id: int, save_optimizer: bool, background: bool = False) -> None:
        """Each worker's part of checkpoint ``rollout_id``, written; with ``background`` copied only (at the step
        boundary), for ``write_checkpoint`` to write."""
        await self._all("save", save_dir, rollout_id, save_optimizer, background)

    async def write_checkpoint(self) -> None:
        """Writes what ``save(..., background=True)`` copied, each worker in its checkpoint concurrency group:
        alongside the calls that train the next steps."""
        try:
            await asyncio.gather(
                *[self._call(rank, a.run_beside.remote("write_checkpoint")) for rank, a in enumerate(self.actors)]
            )
        except Exception as e:
            death = await self.death_behind(e)
            if death is None or death is e:
                raise
            raise death from e

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
        if self._watch is not None:  # first: the kills below would read as deaths
            self._watch.cancel()
            self._watch.add_done_callback(lambda t: t.cancelled() or t.exception())
        for a in self.actors:
            ray.kill(a)


async def race_deaths(aw: Awaitable[T], groups: Iterable[TrainGroup], grace: float = DEATH_GRACE) -> T:
    """Await ``aw`` unless a worker of ``groups`` dies first: then ``aw`` is cancelled (given ``grace`` seconds to run
    its cleanup) and the ``TrainerDied`` raised. A failure of ``aw`` with a death behind it (a call to another actor
    that failed because of it, see ``TrainGroup.death_behind``) is raised as that death too."""
    groups = [g for g in groups if g.watch is not None]
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait([task, *[g.watch for g in groups]], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (Ctrl-C, SIGTERM): ``aw`` cleans up before the run is taken down
        task.cancel()
        await asyncio.wait([task], timeout=grace)
        raise
    if task not in done:
        task.cancel()
        await asyncio.wait([task], timeout=grace)
        watch = next(w for w in done)
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.warning("after %s, the interrupted loop failed: %r", watch.exception(), task.exception())
        raise watch.exception()
    if task.cancelled() or task.exception() is None:
        return task.result()
    error = task.exception()
    for death in await asyncio.gather(*[g.death_behind(error, grace) for g in groups]):
        if death is not None:
            raise death from (None if death is error else error)
    raise error


async def kill_and_wait(handles: Iterable, timeout: float) -> None:
    """``ray.kill`` each actor and wait until Ray reports it dead, so nothing it still did lands after its
    replacement started (a late line in rollouts.jsonl, a file in a checkpoint folder)."""

    async def gone(handle) -> None:
        ray.kill(handle)
        while True:
            try:
                await asyncio.wait_for(handle.pid.remote(), 5)
            except RayActorError:
                return
            except TimeoutError:
                pass
            await asyncio.sleep(0.2)

    try:
        await asyncio.wait_for(asyncio.gather(*[gone(h) for h in handles]), timeout)
    except TimeoutError:
        logger.warning("killed actors not yet reported dead after %.0fs; going on", timeout)
