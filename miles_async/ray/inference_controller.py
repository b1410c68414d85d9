"""The inference controller: a Ray actor that owns the engine processes and their lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os

from miles_async.config import EngineConfig
from miles_async.inference.client import EngineClient
from miles_async.inference.launcher import EngineProcess

logger = logging.getLogger(__name__)


class InferenceController:
    def __init__(self, cfg: EngineConfig, log_dir: str | None = None):
        if cfg.backend != "embedded":
            raise ValueError(f"--rollout-backend {cfg.backend} is not available")
        self.cfg = cfg
        self.engines = [EngineProcess(cfg, i, log_dir) for i in range(cfg.num_engines)]
        self.clients: list[EngineClient] = []

    async def start(self) -> list[str]:
        for e in self.engines:
            e.start()
        # Health polling blocks, so run it off the event loop, all engines at once.
        await asyncio.gather(*[asyncio.to_thread(e.wait_healthy, self.cfg.startup_timeout) for e in self.engines])
        self.clients = [EngineClient(e.url, timeout=self.cfg.request_timeout) for e in self.engines]
        return self.urls()

    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def engine_pids(self) -> list[int]:
        return [e.proc.pid for e in self.engines if e.proc is not None]

    def pid(self) -> int:
        return os.getpid()

    def _check_alive(self) -> None:
        dead = [e for e in self.engines if not e.alive()]
        if dead:
            e = dead[0]
            raise RuntimeError(f"engine {e.index} ({e.url}) died with code {e.proc.returncode}; "
                               f"last log lines:\n{e.tail_log()}")

    async def _all(self, method: str, *args) -> list:
        self._check_alive()
        return await asyncio.gather(*[getattr(c, method)(*args) for c in self.clients])

    async def pause(self, mode: str = "in_place") -> None:
        await self._all("pause", mode)

    async def resume(self) -> None:
        await self._all("resume")

    async def flush_cache(self) -> None:
        await self._all("flush_cache")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self._all("update_weights_from_disk", model_path, weight_version)

    async def weight_versions(self) -> list[int]:
        infos = await self._all("model_info")
        return [int(i["weight_version"]) for i in infos]

    async def busy_seconds(self) -> float:
        """Seconds all engines together spent in forward passes since they started."""
        loads = await self._all("load")
        return float(sum(x.get("busy_seconds", 0.0) for x in loads))

    async def dispose(self) -> None:
        for c in self.clients:
            await c.close()
        for e in self.engines:
            await asyncio.to_thread(e.stop)
