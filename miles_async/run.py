"""The run: builds, connects and disposes of the components; the loop calls one method per thing it does."""

from __future__ import annotations

import asyncio
import logging
import os

import ray
from ray.actor import ActorHandle

from miles_async.config import Config
from miles_async.config.placement import worker_plan
from miles_async.ray.cluster import actor_options, init_ray
from miles_async.ray.inference_controller import InferenceController
from miles_async.ray.placement import GroupPlacement, release, reserve
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.ray.train_group import TrainGroup
from miles_async.utils.async_utils import wait_for
from miles_async.utils.checkpoint import atomic_write_json, mark_complete
from miles_async.weights import driver as weights

logger = logging.getLogger(__name__)


class Run:
    """One training run's handles: the inference controller (engines), the rollout executor, the actor
    and, for PPO, the critic.

    ``Run(cfg)`` joins or starts Ray (once per process). ``async with run:`` builds every component
    and, on the way out (normal end, failure, Ctrl-C or SIGTERM), stops each of them again.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.controller: ActorHandle | None = None
        self.executor: ActorHandle | None = None
        self.actor: TrainGroup | None = None
        self.critic: TrainGroup | None = None
        self.processes_path = os.path.join(cfg.tracking.output_dir, "processes.json")
        self._engine_pids: list[int] = []
        self._engine_busy = 0.0
        self.placement: dict[str, GroupPlacement] = {}
        init_ray(cfg.cluster)

    async def __aenter__(self) -> Run:
        try:
            await self.start()
        except BaseException:
            await self.dispose()  # what did start is stopped again; __aexit__ does not run after a failed enter
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.dispose()

    async def start(self) -> None:
        """The placement groups first (on a cluster with GPUs), then engines and trainers load their models in
        parallel; each start-up surfaces its own errors."""
        self.placement = await reserve(worker_plan(self.cfg), self.cfg.cluster.placement_timeout)
        await asyncio.gather(self._start_rollout(), self._start_trainers())
        self._engine_pids = (await self._record_processes())["engines_started"]
        self._engine_busy = await self.controller.busy_seconds.remote()

    @property
    def _load_rollout_id(self) -> int | None:
        return self.cfg.loop.start_rollout_id - 1 if self.cfg.checkpoint.load else None

    async def _start_rollout(self) -> None:
        cfg = self.cfg
        opts = actor_options(num_threads=1)
        self.controller = (
            ray.remote(InferenceController)
            .options(**opts)
            .remote(cfg.engine, cfg.tracking.output_dir, self.placement.get("rollout"))
        )
        engine_urls = await self.controller.start.remote()
        self.executor = (
            ray.remote(RolloutExecutor)
            .options(**opts, max_concurrency=1000)
            .remote(
                cfg.rollout,
                cfg.eval,
                cfg.engine,
                engine_urls,
                cfg.checkpoint.load,
                self._load_rollout_id,
                cfg.tracking.output_dir,
            )
        )
        await self.executor.pid.remote()  # surfaces constructor errors now, not at the first rollout
        if cfg.engine.fault_tolerance is not None:
            await self.controller.attach.remote(self.executor)

    async def _start_trainers(self) -> None:
        cfg = self.cfg
        total_steps = cfg.loop.num_rollout * cfg.train.num_steps_per_rollout
        self.actor = TrainGroup(
            cfg.train,
            cfg.cluster,
            cfg.cluster.num_train_workers,
            total_steps,
            cfg.checkpoint.load,
            self._load_rollout_id,
            self.placement.get("actor"),
        )
        if cfg.critic is not None:
            self.critic = TrainGroup(
                cfg.critic,
                cfg.cluster,
                cfg.cluster.num_critic_workers,
                total_steps,
                cfg.checkpoint.load,
                self._load_rollout_id,
                self.placement.get("critic"),
            )
        await asyncio.gather(*[g.init() for g in self._models()])

    def _models(self) -> list[TrainGroup]:
        return [g for g in (self.actor, self.critic) if g is not None]

    async def _record_processes(self) -> dict:
        """Write every process the run started, so tests and operators can check none outlives it."""
        procs = {
            "driver": os.getpid(),
            "controller": await self.controller.pid.remote(),
            "engines": await self.controller.engine_pids.remote(),
            "engines_started": await self.controller.all_engine_pids.remote(),
            "executor": await self.executor.pid.remote(),
            "train_workers": [pid for g in self._models() for pid in await g.pids()],
            # Where each training rank and engine server ran, and the GPUs Ray gave it.
            "placement": [
                *[
                    p
                    for role, g in (("actor", self.actor), ("critic", self.critic))
                    if g
                    for p in await g.placement(role)
                ],
                *await self.controller.placement.remote(),
            ],
            "ray_session_dir": ray._private.worker.global_worker.node.get_session_dir_path(),
        }
        atomic_write_json(self.processes_path, procs)
        return procs

    async def generate(self, rollout_id: int) -> dict:
        """One-step-off and --synchronous: generate rollout ``rollout_id`` now.
        Returns ``{"data": [batch ref], "metrics": {...}}``; the batch stays in the object store."""
        return await wait_for(
            self.executor.generate.remote(rollout_id),
            self.cfg.rollout.timeout,
            f"rollout {rollout_id} (--rollout-timeout)",
        )

    async def drain(self, rollout_id: int) -> dict:
        """--fully-async: the next batch the producer, generating all along, has assembled; as ``generate``."""
        return await wait_for(
            self.executor.drain.remote(rollout_id),
            self.cfg.rollout.timeout,
            f"rollout {rollout_id} (--rollout-timeout)",
        )

    async def evaluate(self, rollout_id: int) -> dict:
        return await self.executor.eval.remote(rollout_id)

    async def train_step(self, rollout_id: int, data_ref: ray.ObjectRef) -> dict:
        """One rollout's training. With a critic (ppo): its values feed the actor's GAE, then the
        critic fits the returns while the actor takes its steps (after --num-critic-only-steps)."""
        temperature = self.cfg.rollout.sampling.temperature
        if self.critic is None:
            return await self.actor.train(rollout_id, data_ref, temperature)
        values = ray.put(await self.critic.call("compute_values", rollout_id, data_ref))
        returns = ray.put(await self.actor.call("prepare", rollout_id, data_ref, temperature, values))
        jobs = [self.critic.train(rollout_id, data_ref, values, returns)]
        if rollout_id >= self.cfg.loop.num_critic_only_steps:
            jobs.append(self.actor.train(rollout_id, data_ref, temperature, values))
        metrics: dict = {}
        for m in await asyncio.gather(*jobs):
            metrics.update(m)
        return metrics

    async def update_weights(self, weight_version: int) -> dict:
        """The actor's weights to every serving engine; then the rollout side samples from ``weight_version``."""
        return await weights.update_weights(
            self.cfg, self.controller, self.actor, lambda version: self.executor.on_step.remote(version), weight_version
        )

    async def save(self, rollout_id: int) -> None:
        save_dir = self.cfg.checkpoint.save
        await asyncio.gather(
            *[g.save(save_dir, rollout_id, not self.cfg.checkpoint.no_save_optim) for g in self._models()]
        )
        await self.executor.save.remote(rollout_id, save_dir)
        mark_complete(save_dir, rollout_id)  # last, and atomic: only now is this iteration "latest"

    async def save_hf(self, path: str) -> None:
        await self.actor.save_hf(path)

    async def health(self, step_seconds: float) -> dict:
        """The engines' idle share of the last ``step_seconds``; with --use-fault-tolerance their health
        metrics too, and processes.json is rewritten when an engine was restarted, so whoever checks that
        no process outlives the run sees the new one too."""
        busy = await self.controller.busy_seconds.remote()
        metrics = {
            "engine/idle_frac": max(0.0, 1 - (busy - self._engine_busy) / (self.cfg.engine.num_engines * step_seconds))
        }
        self._engine_busy = busy
        if self.cfg.engine.fault_tolerance is None:
            return metrics
        metrics.update(await self.controller.health_metrics.remote())
        metrics["engine/request_retries"] = float(await self.executor.router_retries.remote())
        pids = await self.controller.all_engine_pids.remote()
        if pids != self._engine_pids:
            await self._record_processes()
            self._engine_pids = pids
        return metrics

    async def dispose(self) -> None:
        """Best effort, each step independent: a failure in one must not leave the others running."""
        for name, handle in (("executor", self.executor), ("controller", self.controller)):
            if handle is None:
                continue
            try:
                await asyncio.wait_for(handle.dispose.remote(), 30)
            except Exception as e:
                logger.warning("disposing of the %s failed: %r", name, e)
            ray.kill(handle)
        for group in self._models():
            group.dispose()
        release(self.placement)
        self.placement = {}
