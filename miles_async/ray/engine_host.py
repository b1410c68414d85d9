"""Engines as the inference controller drives them: a server it starts, probes, reads the log of and stops.

``LocalEngine`` runs the server as the controller's own child (a laptop run: no GPUs in the Ray cluster).
``PlacedEngine`` runs it on the engine's placement-group bundle, wherever Ray put that bundle, through an
``EngineHost``: a small Ray actor that holds the bundle's GPUs and starts the server as its child, listening on
its node's address with the bundle's ``CUDA_VISIBLE_DEVICES``; reachable from other nodes, the server requires the
run's API key (``EngineConfig.api_key``, ``inference/auth.py``), which the controller's probes and clients send.
A restart starts a new server in the same host, so a restarted engine comes back on the same bundle (a new host on
that bundle if the old one died with its node).
Both answer the same async methods, so the controller has one code path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import ray
from ray.exceptions import RayActorError

from miles_async.config import EngineConfig
from miles_async.inference.engines import make_engine_process
from miles_async.inference.launcher import EngineProcess
from miles_async.ray.placement import GroupPlacement, where

logger = logging.getLogger(__name__)


class _Server:
    """One engine's current server process, restarted in place; what both kinds of engine run."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None, own_gpus: bool):
        self.cfg, self.index, self.log_dir, self.own_gpus = cfg, index, log_dir, own_gpus
        self.proc: EngineProcess | None = None

    async def start(self) -> dict:
        """A fresh server (new port); what the controller records about it."""
        self.proc = make_engine_process(self.cfg, self.index, self.log_dir)
        if self.own_gpus:
            self.proc.gpu_slot = 0
        self.proc.start()
        return self._info()

    def _info(self) -> dict:
        return {
            "url": self.proc.url,
            "pid": self.proc.proc.pid,
            "pids": list(self.proc.pids),
            "log_path": str(self.proc.log_path) if self.proc.log_path else None,
            "where": where("rollout", self.index, self.proc.proc.pid),
        }

    async def wait_healthy(self, timeout: float) -> dict:
        """Until the server answers; what the controller records about it then (a server started again because
        its port was taken has a new port and pid)."""
        await asyncio.to_thread(self.proc.wait_healthy, timeout)
        return self._info()

    async def state(self) -> tuple[bool, int | None]:
        """(alive, exit code)."""
        if self.proc is None or self.proc.proc is None:
            return False, None
        return self.proc.alive(), self.proc.proc.returncode

    async def tail_log(self, n: int) -> str:
        return self.proc.tail_log(n) if self.proc is not None else ""

    async def stop(self, grace: float | None = None) -> None:
        """The server; a later ``start`` starts a new one."""
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop, *(() if grace is None else (grace,)))


class EngineHost(_Server):
    """The Ray actor on one rollout bundle. Async, so the server is started from the actor's one event-loop thread:
    the server dies with that thread's process (PR_SET_PDEATHSIG), and probes run while it starts."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None):
        from miles_async.config.machine import Machine

        # Reachable from the other nodes, and the engine's own build: GPU where this node has CUDA.
        cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address(), use_gpu=Machine.cuda_devices() > 0)
        super().__init__(cfg, index, log_dir, own_gpus=True)

    async def start(self) -> dict:
        await self.stop(1.0)
        return await super().start()


class LocalEngine(_Server):
    """An engine server that is the controller's own child."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None):
        super().__init__(cfg, index, log_dir, own_gpus=False)
        self.url, self.pid, self.log_path, self.where = "", None, None, {}
        self.pids: list[int] = []  # the current server's processes: its first start's, then each start again's

    def _started(self, info: dict) -> None:
        self.url, self.pid, self.log_path, self.where = info["url"], info["pid"], info["log_path"], info["where"]
        self.pids = info["pids"]

    async def start(self) -> None:
        self._started(await super().start())

    async def wait_healthy(self, timeout: float) -> None:
        self._started(await super().wait_healthy(timeout))

    async def close(self) -> None:
        """The server, for good."""
        await self.stop()


class PlacedEngine(LocalEngine):
    """An engine server on its placement-group bundle's node, run by an ``EngineHost`` there."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None, placement: GroupPlacement):
        super().__init__(cfg, index, log_dir)
        self._spawn = lambda: (
            ray.remote(EngineHost).options(num_cpus=0, **placement.options(index)).remote(cfg, index, log_dir)
        )
        self.host = None

    async def start(self) -> None:
        if self.host is None:
            self.host = self._spawn()
        try:
            info = await self.host.start.remote()
        except RayActorError:  # the host died (its node, e.g.): a new one on the same bundle
            logger.warning("engine %d's host actor is gone; starting a new one on the same bundle", self.index)
            self.host = self._spawn()
            info = await self.host.start.remote()
        self._started(info)

    async def wait_healthy(self, timeout: float) -> None:
        self._started(await self.host.wait_healthy.remote(timeout))

    async def state(self) -> tuple[bool, int | None]:
        try:
            return await self.host.state.remote()
        except RayActorError:
            return False, None

    async def tail_log(self, n: int) -> str:
        try:
            return await self.host.tail_log.remote(n)
        except RayActorError as e:
            return f"(the engine's host actor is gone: {e})"

    async def stop(self, grace: float | None = None) -> None:
        if self.host is None:
            return
        try:
            await self.host.stop.remote(grace)
        except RayActorError:
            pass  # gone with its host: the server died with it (PR_SET_PDEATHSIG)

    async def close(self) -> None:
        await self.stop()
        if self.host is not None:
            ray.kill(self.host)
            self.host = None


def make_engines(cfg: EngineConfig, log_dir: str | None, placement: GroupPlacement | None) -> list[LocalEngine]:
    """The controller's engines: on their bundles when the run has a rollout placement group, else its children."""
    if placement is None:
        return [LocalEngine(cfg, i, log_dir) for i in range(cfg.num_engines)]
    return [PlacedEngine(cfg, i, log_dir, placement) for i in range(cfg.num_engines)]
