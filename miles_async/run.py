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
from miles_async.ray.train_group import TrainGroup, kill_and_wait, race_deaths
from miles_async.ray.trainer_recovery import RestorePoint, TrainerDied, TrainerRecovery
from miles_async.utils.async_utils import wait_for
from miles_async.utils.checkpoint import (
    BackgroundSave,
    atomic_write_json,
    iteration_dir,
    latest_checkpointed_iteration,
    mark_complete,
)
from miles_async.weights import driver as weights

logger = logging.getLogger(__name__)

# How long leaving the run waits for a checkpoint still being written in the background.
BACKGROUND_SAVE_DRAIN_SECONDS = 600.0


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
        # What the trainers and the data source start from: the run's --load, or after a trainer restart
        # (--use-fault-tolerance) the checkpoint it restored.
        self.restore = (
            RestorePoint(cfg.checkpoint.load, cfg.loop.start_rollout_id - 1) if cfg.checkpoint.load else RestorePoint()
        )
        self.recovery = TrainerRecovery(cfg.cluster.max_trainer_restarts, cfg.checkpoint.save, self.restore)
        self._started: dict[str, list[int]] = {"train_workers": [], "executor": []}
        self._background_save = BackgroundSave()  # --async-save: the checkpoint being written while training goes on
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
        return self.restore.rollout_id

    async def _start_rollout(self) -> None:
        cfg = self.cfg
        opts = actor_options(num_threads=1)
        self.controller = (
            ray.remote(InferenceController)
            .options(**opts)
            .remote(cfg.engine, cfg.tracking.output_dir, self.placement.get("rollout"))
        )
        # The executor (a process, its imports, the tokenizer, the data) starts while the engines boot; the
        # controller gives it the engines once they answer.
        await asyncio.gather(self.controller.start.remote(), self._start_executor())
        await self.controller.attach.remote(self.executor)

    async def _start_executor(self) -> None:
        """A rollout executor without engines: ``controller.attach`` gives it those serving, and with
        --use-fault-tolerance every change."""
        cfg = self.cfg
        opts = actor_options(num_threads=1)
        self.executor = (
            ray.remote(RolloutExecutor)
            .options(**opts, max_concurrency=1000)
            .remote(
                cfg.rollout,
                cfg.eval,
                cfg.engine,
                [],
                self.restore.load_dir,
                self._load_rollout_id,
                cfg.tracking.output_dir,
                tools=cfg.tools,
            )
        )
        await self.executor.pid.remote()  # surfaces constructor errors now, not at the first rollout

    async def _start_trainers(self) -> None:
        cfg = self.cfg
        total_steps = cfg.loop.num_rollout * cfg.train.num_steps_per_rollout
        self.actor = TrainGroup(
            cfg.train,
            cfg.cluster,
            cfg.cluster.num_train_workers,
            total_steps,
            self.restore.load_dir,
            self._load_rollout_id,
            self.placement.get("actor"),
        )
        if cfg.critic is not None:
            self.critic = TrainGroup(
                cfg.critic,
                cfg.cluster,
                cfg.cluster.num_critic_workers,
                total_steps,
                self.restore.load_dir,
                self._load_rollout_id,
                self.placement.get("critic"),
            )
        await asyncio.gather(*[g.init() for g in self._models()])

    def _models(self) -> list[TrainGroup]:
        return [g for g in (self.actor, self.critic) if g is not None]

    async def watch_trainers(self, aw):
        """``aw`` (the loop), raced against the death of any training worker: ``TrainerDied`` names it, whatever
        the loop awaited then (a train step, a weight push, a save, a rollout)."""
        return await race_deaths(aw, self._models())

    async def recover_trainers(self, death: TrainerDied) -> int:
        """A training worker died. Without --use-fault-tolerance, or past --max-trainer-restarts, raises
        ``TrainerFailed`` naming it. Else rebuilds every training group from the last complete checkpoint (or
        where the run started) and the rollout executor from the same checkpoint's data position, attached to the
        engines that stay up; returns the rollout to go on from (the loop then pushes the restored weights)."""
        save = self.cfg.checkpoint.save
        self.restore = self.recovery.on_death(death, latest_checkpointed_iteration(save) if save else None)
        logger.warning(
            "%s; trainer restart %d of --max-trainer-restarts %d: rebuilding the training workers and the rollout "
            "executor from %s, then going on from rollout %d",
            death,
            self.recovery.restarts,
            self.recovery.max_restarts,
            self.restore.describe(),
            self.restore.start,
        )
        old = [a for g in self._models() for a in g.actors]
        self._background_save.abandon()  # its writers are the workers about to be replaced
        for g in self._models():
            g.dispose()
        try:
            await asyncio.wait_for(self.executor.dispose.remote(), 30)
        except Exception as e:
            logger.warning("disposing of the rollout executor failed: %r", e)
        # The old executor must not append to rollouts.jsonl, nor the old workers write to a checkpoint
        # folder, once their replacements run.
        await kill_and_wait([*old, self.executor], 60)
        self.actor = self.critic = self.executor = None
        await asyncio.gather(self._start_executor(), self._start_trainers())
        await self.controller.attach.remote(self.executor)
        await self._record_processes()
        return self.restore.start

    async def _record_processes(self) -> dict:
        """Write every process the run started, so tests and operators can check none outlives it."""
        procs = {
            "driver": os.getpid(),
            "controller": await self.controller.pid.remote(),
            "engines": await self.controller.engine_pids.remote(),
            "engines_started": await self.controller.all_engine_pids.remote(),
            "executor": await self.executor.pid.remote(),
            "train_workers": [pid for g in self._models() for pid in await g.pids()],
            # Every training worker and executor the run started (restarted ones too: --use-fault-tolerance).
            "train_workers_started": self._started["train_workers"],
            "executors_started": self._started["executor"],
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
        for key, started in (("train_workers", procs["train_workers"]), ("executor", [procs["executor"]])):
            self._started[key].extend(p for p in started if p not in self._started[key])
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

    async def save(self, rollout_id: int, force_sync: bool = False) -> None:
        """Checkpoint ``rollout_id``, every part taken now (the step boundary). With --async-save, unless
        ``force_sync`` (sentinel, control-API and final saves), the trainers' parts are copied and written while
        the loop goes on; else written before this returns. A save still in flight is waited for first: at most
        one is."""
        await self.wait_save()
        ckpt = self.cfg.checkpoint
        background = ckpt.async_save and not force_sync
        await asyncio.gather(
            *[g.save(ckpt.save, rollout_id, not ckpt.no_save_optim, background) for g in self._models()]
        )
        await self.executor.save.remote(rollout_id, ckpt.save)
        write = self._write_and_mark(ckpt.save, rollout_id)
        if background:
            self._background_save.start(write, iteration_dir(ckpt.save, rollout_id))
        else:
            await write

    async def _write_and_mark(self, save_dir: str, rollout_id: int) -> None:
        await asyncio.gather(*[g.write_checkpoint() for g in self._models()])
        mark_complete(save_dir, rollout_id)  # last, and atomic: only now is this iteration "latest"

    def check_save(self) -> None:
        """At a step boundary: raises if the checkpoint written in the background failed, naming its folder."""
        self._background_save.check()

    async def wait_save(self) -> None:
        """Until the checkpoint written in the background, if any, is complete; raises naming its folder if it
        failed (the write is a call to the trainers, which fails if one of them dies)."""
        await self._background_save.wait()

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
        # Rows of steps done again after a trainer restart repeat their step; this tells them apart.
        metrics["trainer/restarts"] = float(self.recovery.restarts)
        metrics["engine/request_retries"] = float(await self.executor.router_retries.remote())
        pids = await self.controller.all_engine_pids.remote()
        if pids != self._engine_pids:
            await self._record_processes()
            self._engine_pids = pids
        return metrics

    async def dispose(self) -> None:
        """Best effort, each step independent: a failure in one must not leave the others running."""
        if self._background_save.in_flight is not None:
            try:  # the trainers hold the checkpoint being written: finish it before they are stopped
                await asyncio.wait_for(self.wait_save(), BACKGROUND_SAVE_DRAIN_SECONDS)
            except Exception as e:
                logger.warning("the checkpoint written in the background did not complete: %r", e)
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
