"""Building, connecting and disposing of the run's components."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import ray

from miles_async.config import Config
from miles_async.ray.cluster import actor_options, init_ray
from miles_async.ray.inference_controller import InferenceController
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.ray.train_group import TrainGroup
from miles_async.utils.checkpoint import atomic_write_json, mark_complete

logger = logging.getLogger(__name__)


@dataclass
class Components:
    controller: ray.actor.ActorHandle | None = None
    executor: ray.actor.ActorHandle | None = None
    actor: TrainGroup | None = None
    critic: TrainGroup | None = None
    engine_urls: list[str] = field(default_factory=list)


async def create_rollout_components(cfg: Config, comps: Components) -> None:
    init_ray(cfg.cluster)
    opts = actor_options(cfg.cluster, num_threads=1)
    comps.controller = ray.remote(InferenceController).options(**opts).remote(cfg.engine, cfg.tracking.output_dir)
    comps.engine_urls = await comps.controller.start.remote()
    load_id = cfg.loop.start_rollout_id - 1 if cfg.checkpoint.load else None
    comps.executor = ray.remote(RolloutExecutor).options(**opts, max_concurrency=1000).remote(
        cfg.rollout, cfg.eval, comps.engine_urls, cfg.engine.request_timeout, cfg.checkpoint.load, load_id,
        cfg.tracking.output_dir, cfg.engine)
    await comps.executor.pid.remote()  # surfaces constructor errors now, not at the first rollout
    if cfg.engine.fault_tolerance is not None:
        await comps.controller.attach.remote(comps.executor)


async def create_training_models(cfg: Config, comps: Components) -> None:
    total_steps = cfg.loop.num_rollout * cfg.train.num_steps_per_rollout
    load_id = cfg.loop.start_rollout_id - 1 if cfg.checkpoint.load else None
    comps.actor = TrainGroup(cfg.train, cfg.cluster, cfg.cluster.num_train_workers, total_steps, cfg.checkpoint.load,
                             load_id)
    if cfg.critic is not None:
        comps.critic = TrainGroup(cfg.critic, cfg.cluster, cfg.cluster.num_critic_workers, total_steps,
                                  cfg.checkpoint.load, load_id)
    await asyncio.gather(*[g.init() for g in (comps.actor, comps.critic) if g is not None])


async def train_step(cfg: Config, comps: Components, rollout_id: int, data_ref: ray.ObjectRef) -> dict:
    """One rollout's training. With a critic (ppo): its values feed the actor's GAE, then the
    critic fits the returns while the actor takes its steps (after --num-critic-only-steps)."""
    temperature = cfg.rollout.sampling.temperature
    if comps.critic is None:
        return await comps.actor.train(rollout_id, data_ref, temperature)
    values = ray.put(await comps.critic.call("compute_values", rollout_id, data_ref))
    returns = ray.put(await comps.actor.call("prepare", rollout_id, data_ref, temperature, values))
    jobs = [comps.critic.train(rollout_id, data_ref, values, returns)]
    if rollout_id >= cfg.loop.num_critic_only_steps:
        jobs.append(comps.actor.train(rollout_id, data_ref, temperature, values))
    metrics: dict = {}
    for m in await asyncio.gather(*jobs):
        metrics.update(m)
    return metrics


async def record_processes(comps: Components, path: str) -> dict:
    """Write every process the run started, so tests and operators can check none outlives it."""
    import os

    procs = {"driver": os.getpid(), "controller": await comps.controller.pid.remote(),
             "engines": await comps.controller.engine_pids.remote(),
             "engines_started": await comps.controller.all_engine_pids.remote(),
             "executor": await comps.executor.pid.remote(),
             "train_workers": await comps.actor.pids() + (await comps.critic.pids() if comps.critic else []),
             "ray_session_dir": ray._private.worker.global_worker.node.get_session_dir_path()}
    atomic_write_json(path, procs)
    return procs


async def update_weights(cfg: Config, comps: Components, weight_version: int) -> dict:
    """Pause the engines (requests freeze in place), stream the weights in, flush and continue.

    With --use-fault-tolerance an engine that dies during the push is left out: the push goes
    again to the engines still serving (the version flips only with the last bucket, so a
    repeated push is harmless); a restarted engine is seeded from a peer after the update.
    """
    t0 = time.time()
    if cfg.engine.weight_update_method == "disk":
        return await _update_weights_from_disk(cfg, comps, weight_version, t0)
    urls = await comps.controller.begin_weight_update.remote(cfg.loop.pause_generation_mode)
    try:
        for attempt in range(cfg.engine.num_engines + 1):
            try:
                metrics = await comps.actor.push_weights(urls, weight_version, cfg.engine.dtype,
                                                         cfg.engine.request_timeout, cfg.engine.weight_update_method,
                                                         cfg.engine.num_gpus_per_engine, cfg.engine.backend)
                break
            except Exception as e:
                if cfg.engine.fault_tolerance is None:
                    raise
                await comps.controller.weight_versions.remote()  # reports the engines that fail to answer
                still = await comps.controller.serving_urls.remote()
                if set(still) == set(urls) or not still or attempt == cfg.engine.num_engines:
                    raise
                logger.warning("weight push to %s failed (%s); pushing again to the engines still serving: %s",
                               urls, e, still)
                urls = still
    finally:
        await comps.controller.end_weight_update.remote()
    versions = await comps.controller.weight_versions.remote()
    if any(v != weight_version for v in versions):
        raise RuntimeError(f"weight update to version {weight_version} did not reach every engine: {versions}")
    if cfg.engine.check_weight_update_equal:
        await check_weight_update_equal(cfg, comps, weight_version)
    await comps.executor.on_step.remote(weight_version)
    metrics["weights/update_seconds"] = time.time() - t0
    metrics["weights/version"] = weight_version
    return metrics


def weight_update_dir(cfg: Config) -> str:
    """Where the disk route writes: --weight-update-dir, else memory-backed /dev/shm, else the output dir."""
    import os

    if cfg.engine.weight_update_dir:
        return cfg.engine.weight_update_dir
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return f"/dev/shm/miles-async-weights-{os.getpid()}"
    return os.path.join(cfg.tracking.output_dir, "engine_weights")


async def _update_weights_from_disk(cfg: Config, comps: Components, weight_version: int, t0: float) -> dict:
    """SGLang and vLLM: the trainer writes an HF folder (while the engines still generate), then the engines
    pause, load it (SGLang's ``/update_weights_from_disk``, vLLM's ``reload_weights``, each with the version),
    flush their prefix cache and continue; the folder is removed once loaded."""
    import shutil
    from pathlib import Path

    path = Path(weight_update_dir(cfg)) / f"v{weight_version}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        metrics = await comps.actor.call("save_weights_for_engines", str(path), weight_version, cfg.engine.dtype)
        t_load = time.time()
        await comps.controller.begin_weight_update.remote(cfg.loop.pause_generation_mode)
        try:
            # Both flush their prefix cache as part of the update (SGLang's flush_cache defaults to true; the
            # vLLM client resets it after reload_weights).
            await comps.controller.update_weights_from_disk.remote(str(path), weight_version)
        finally:
            await comps.controller.end_weight_update.remote()
        metrics["weights/load_seconds"] = time.time() - t_load
    finally:
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.parent.rmdir()  # only when empty
        except OSError:
            pass
    versions = await comps.controller.weight_versions.remote()
    if any(v != weight_version for v in versions):
        raise RuntimeError(f"weight update to version {weight_version} did not reach every engine: {versions}")
    await comps.executor.on_step.remote(weight_version)
    metrics["weights/update_seconds"] = time.time() - t0
    metrics["weights/version"] = weight_version
    return metrics


class WeightMismatchError(RuntimeError):
    pass


async def check_weight_update_equal(cfg: Config, comps: Components, weight_version: int) -> None:
    """--check-weight-update-equal: every serving engine holds, byte for byte, the trainer's weights cast to
    the engine dtype; else fail naming the engine and the first tensor that differs."""
    from miles_async.utils.weight_checksum import first_mismatch

    trainer = await comps.actor.call("weights_checksum", cfg.engine.dtype)
    for url, engine in (await comps.controller.weights_checksums.remote()).items():
        mismatch = first_mismatch(trainer, engine)
        if mismatch:
            raise WeightMismatchError(f"--check-weight-update-equal: after the update to weight version "
                                      f"{weight_version}, the engine at {url} does not hold the trainer's weights: "
                                      f"{mismatch}")
    logger.info("--check-weight-update-equal: version %d identical on %s", weight_version,
                await comps.controller.serving_urls.remote())


async def engine_health(cfg: Config, comps: Components, processes_path: str, known_pids: list[int]) -> dict:
    """--use-fault-tolerance: the engines' health metrics; processes.json is rewritten when an engine was
    restarted, so whoever checks that no process outlives the run sees the new one too."""
    if cfg.engine.fault_tolerance is None:
        return {}
    metrics = await comps.controller.health_metrics.remote()
    metrics["engine/request_retries"] = float(await comps.executor.router_retries.remote())
    pids = await comps.controller.all_engine_pids.remote()
    if pids != known_pids:
        await record_processes(comps, processes_path)
        known_pids[:] = pids
    return metrics


async def save_checkpoint(cfg: Config, comps: Components, rollout_id: int) -> None:
    save_dir = cfg.checkpoint.save
    await asyncio.gather(*[g.save(save_dir, rollout_id, not cfg.checkpoint.no_save_optim)
                           for g in (comps.actor, comps.critic) if g is not None])
    await comps.executor.save.remote(rollout_id, save_dir)
    mark_complete(save_dir, rollout_id)  # last, and atomic: only now is this iteration "latest"


async def dispose(comps: Components) -> None:
    """Best effort, each step independent: a failure in one must not leave the others running."""
    for name, step in (("executor", lambda: comps.executor.dispose.remote()),
                       ("controller", lambda: comps.controller.dispose.remote())):
        handle = getattr(comps, name)
        if handle is None:
            continue
        try:
            await asyncio.wait_for(step(), 30)
        except Exception as e:
            logger.warning("disposing of the %s failed: %r", name, e)
        ray.kill(handle)
    for group in (comps.actor, comps.critic):
        if group is not None:
            group.dispose()
