"""One weight update, end to end: the trainer's weights go to every serving engine by the
configured route (tensors streamed in, or an HF folder on disk), then the engines' versions are
checked and the rollout side is told which weights it now samples from."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from miles_async.config import Config
from miles_async.utils.weight_checksum import first_mismatch
from miles_async.weights import staged
from miles_async.weights.update import DISK, SHARED_MEMORY, WeightUpdate, route_for

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from miles_async.ray.train_group import TrainGroup

logger = logging.getLogger(__name__)

OnUpdated = Callable[[int], Awaitable[None]]


class WeightMismatchError(RuntimeError):
    pass


async def update_weights(
    cfg: Config, controller: ActorHandle, actor: TrainGroup, on_updated: OnUpdated, weight_version: int
) -> dict:
    """Pause the engines (requests freeze in place), stream the weights in, flush and continue.

    With --use-fault-tolerance an engine that dies during the push is left out: the push goes
    again to the engines still serving (the version flips only with the last bucket, so a
    repeated push is harmless); a restarted engine is seeded from a peer after the update.
    ``on_updated(weight_version)`` runs once every engine serves the new version.
    """
    t0 = time.time()
    update = weight_update(cfg, weight_version)
    if update.route == DISK:
        metrics = await _update_weights_from_disk(cfg, controller, actor, update)
    else:
        metrics = await _push_weights(cfg, controller, actor, update)
    await _confirm(cfg, controller, actor, weight_version)
    await on_updated(weight_version)
    metrics["weights/update_seconds"] = time.time() - t0
    metrics["weights/version"] = weight_version
    return metrics


def weight_update(cfg: Config, weight_version: int) -> WeightUpdate:
    """The record of update ``weight_version`` as configured; a push fills in the serving engines as targets."""
    route = route_for(cfg.engine.weight_update_method, cfg.engine.backend)
    return WeightUpdate(
        version=weight_version,
        route=route,
        dtype=cfg.engine.dtype,
        timeout=cfg.engine.request_timeout,
        engine=cfg.engine.backend,
        bucket_bytes=cfg.train.update_weight_buffer_size,
        ranks_per_engine=cfg.engine.num_gpus_per_engine,
        folder=str(Path(weight_update_dir(cfg)) / f"v{weight_version}") if route == DISK else None,
        flush_cache=cfg.loop.pause_generation_mode != "in_place",
        api_key=cfg.engine.api_key,
    )


async def _push_weights(cfg: Config, controller: ActorHandle, actor: TrainGroup, update: WeightUpdate) -> dict:
    if update.route == SHARED_MEMORY and staged.stages(update.engine):
        return await _stage_then_commit(cfg, controller, actor, update)
    t_pause = time.time()
    urls = await controller.begin_weight_update.remote(cfg.loop.pause_generation_mode)
    try:
        metrics = await _push_paused(cfg, controller, actor, update, urls)
    finally:
        await controller.end_weight_update.remote()
    metrics["weights/pause_seconds"] = time.time() - t_pause
    return metrics


async def _push_paused(
    cfg: Config, controller: ActorHandle, actor: TrainGroup, update: WeightUpdate, urls: list[str]
) -> dict:
    """Push to the paused engines ``urls``; with --use-fault-tolerance again to the ones still serving."""
    for attempt in range(cfg.engine.num_engines + 1):
        try:
            return await actor.push_weights(replace(update, targets=tuple(urls)))
        except Exception as e:
            if cfg.engine.fault_tolerance is None:
                raise
            await controller.weight_versions.remote()  # reports the engines that fail to answer
            still = await controller.serving_urls.remote()
            if set(still) == set(urls) or not still or attempt == cfg.engine.num_engines:
                raise
            logger.warning(
                "weight push to %s failed (%s); pushing again to the engines still serving: %s", urls, e, still
            )
            urls = still
    raise AssertionError("unreachable")


async def _stage_then_commit(cfg: Config, controller: ActorHandle, actor: TrainGroup, update: WeightUpdate) -> dict:
    """The embedded engine on the trainer's node, off the critical path: the trainer writes the update into
    shared memory and the engines map it while they still generate; the pause then only covers the copy into
    their parameters (each engine's commit is one step between two decode steps). Engines that were not staged
    (on another node, or serving only since) get a plain push while paused."""
    urls = list(await controller.serving_urls.remote())
    try:
        metrics = await actor.push_weights(replace(update, targets=tuple(urls), stage_only=True))
    except Exception as e:
        if cfg.engine.fault_tolerance is None:
            raise
        logger.warning("staging the weights on %s failed (%s); pushing them once the engines are paused", urls, e)
        metrics = {}
    staged_urls = set(metrics.pop("staged_urls", ()))
    t_pause = time.time()
    serving = await controller.begin_weight_update.remote(cfg.loop.pause_generation_mode)
    try:
        committed = [u for u in serving if u in staged_urls]
        try:
            await staged.commit(
                committed, update.version, update.timeout, update.engine, update.flush_cache, update.api_key
            )
        except Exception as e:
            if cfg.engine.fault_tolerance is None:
                raise
            logger.warning("committing the staged weights on %s failed (%s); pushing them instead", committed, e)
            committed = []
        rest = [u for u in serving if u not in committed]
        if rest:
            metrics.update(await _push_paused(cfg, controller, actor, update, rest))
    finally:
        await controller.end_weight_update.remote()
    metrics["weights/pause_seconds"] = time.time() - t_pause
    return metrics


def weight_update_dir(cfg: Config) -> str:
    """Where the disk route writes: --weight-update-dir, else memory-backed /dev/shm, else the output dir."""
    if cfg.engine.weight_update_dir:
        return cfg.engine.weight_update_dir
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return f"/dev/shm/miles-async-weights-{os.getpid()}"
    return os.path.join(cfg.tracking.output_dir, "engine_weights")


async def _update_weights_from_disk(
    cfg: Config, controller: ActorHandle, actor: TrainGroup, update: WeightUpdate
) -> dict:
    """SGLang and vLLM: the trainer writes an HF folder (while the engines still generate), then the engines
    pause, load it (SGLang's ``/update_weights_from_disk``, vLLM's ``reload_weights``, each with the version),
    flush their prefix cache and continue; the folder is removed once loaded."""
    path = Path(update.folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        metrics = await actor.call("save_weights_for_engines", update)
        t_load = time.time()
        await controller.begin_weight_update.remote(cfg.loop.pause_generation_mode)
        try:
            # Both flush their prefix cache as part of the update (SGLang's flush_cache defaults to true; the
            # vLLM client resets it after reload_weights).
            await controller.update_weights_from_disk.remote(str(path), update.version)
        finally:
            await controller.end_weight_update.remote()
        metrics["weights/load_seconds"] = time.time() - t_load
    finally:
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.parent.rmdir()  # only when empty
        except OSError:
            pass
    return metrics


async def _confirm(cfg: Config, controller: ActorHandle, actor: TrainGroup, weight_version: int) -> None:
    """Every serving engine reports the new version (and, with --check-weight-update-equal, its bytes)."""
    versions = await controller.weight_versions.remote()
    if any(v != weight_version for v in versions):
        raise RuntimeError(f"weight update to version {weight_version} did not reach every engine: {versions}")
    if cfg.engine.check_weight_update_equal:
        await check_weight_update_equal(cfg, controller, actor, weight_version)


async def check_weight_update_equal(
    cfg: Config, controller: ActorHandle, actor: TrainGroup, weight_version: int
) -> None:
    """--check-weight-update-equal: every serving engine holds, byte for byte, the trainer's weights cast to
    the engine dtype; else fail naming the engine and the first tensor that differs."""
    trainer = await actor.call("weights_checksum", cfg.engine.dtype)
    for url, engine in (await controller.weights_checksums.remote()).items():
        mismatch = first_mismatch(trainer, engine)
        if mismatch:
            raise WeightMismatchError(
                f"--check-weight-update-equal: after the update to weight version "
                f"{weight_version}, the engine at {url} does not hold the trainer's weights: "
                f"{mismatch}"
            )
    logger.info(
        "--check-weight-update-equal: version %d identical on %s",
        weight_version,
        await controller.serving_urls.remote(),
    )
