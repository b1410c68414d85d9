"""The inference controller: a Ray actor that owns the engine processes and their lifecycle.

Without ``--use-fault-tolerance`` a dead engine fails the next call (pause, resume, ...) with
its exit code and log tail, and the rollout that used it fails with the router's error.

With it, the controller runs ``EngineSupervisor.tick`` every ``--rollout-health-check-interval``
(probes: process alive, then ``/health`` within ``--rollout-health-check-timeout``). A failed
engine is taken out of the router at once (``attach``ed listeners get ``set_engines``), then
restarted on a new port and seeded with the current weights before it serves again.

Where the restarted engine's weights come from: a serving peer engine (``/get_weights``), like
slime's restart with remote-instance weight loading. The weights live in the trainer, but the
trainer's live weights may already be a step ahead of what the engines serve (it trains while
they generate), so pushing them under the engines' version would mislabel them; the peers hold
exactly the current version. A peer is read only while no weight update runs (``_weights_lock``,
held from ``begin_weight_update`` to ``end_weight_update``), so every serving engine holds the
same version then. The price: with every engine down at once there is no peer, and the run
fails (``AllEnginesFailed``) instead of waiting for the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from miles_async.config import EngineConfig
from miles_async.inference.client import EngineClient, EngineError
from miles_async.inference.engines import make_client
from miles_async.inference.fault_tolerance import (
    AllEnginesFailed,
    EngineSupervisor,
    FaultTolerancePolicy,
    Probe,
)
from miles_async.inference.router import is_engine_failure
from miles_async.ray.engine_host import make_engines
from miles_async.ray.placement import GroupPlacement
from miles_async.utils.weight_checksum import first_mismatch

logger = logging.getLogger(__name__)

SEED_BUCKET_BYTES = 512 * 1024**2
# How long a failed health check waits for the server's process to be seen exiting before calling it unhealthy.
EXIT_GRACE_S = 2.0


class InferenceController:
    def __init__(self, cfg: EngineConfig, log_dir: str | None = None, placement: GroupPlacement | None = None):
        self.cfg = cfg
        self.log_dir = log_dir
        # Each engine on its bundle of the rollout placement group (a cluster with GPUs), else a child of this actor.
        self.engines = make_engines(cfg, log_dir, placement)
        self._tails = [""] * cfg.num_engines  # each engine's log tail when it last failed a probe
        self.started_pids: list[int] = []
        self.clients: list[EngineClient] = []
        self.supervisor: EngineSupervisor | None = None
        self._listeners: list = []
        self._weights_lock = asyncio.Lock()
        self._health_task: asyncio.Task | None = None
        self._fatal: str | None = None
        self._busy_last = [0.0] * cfg.num_engines
        self._busy_offset = [0.0] * cfg.num_engines

    async def start(self) -> list[str]:
        await asyncio.gather(*[e.start() for e in self.engines])
        self._record_started()
        await asyncio.gather(*[e.wait_healthy(self.cfg.startup_timeout) for e in self.engines])
        self._record_started()
        self.clients = [
            make_client(self.cfg.backend, e.url, self.cfg.request_timeout, self.cfg.api_key) for e in self.engines
        ]
        ft = self.cfg.fault_tolerance
        if ft is not None:
            policy = FaultTolerancePolicy(
                ft.failure_threshold, ft.max_engine_restarts, ft.restart_backoff_base, ft.restart_backoff_cap
            )
            self.supervisor = EngineSupervisor(
                len(self.engines),
                policy,
                time.monotonic,
                self._probe,
                self._restart,
                self._on_serving_changed,
                self._describe,
            )
            self._health_task = asyncio.ensure_future(self._health_loop())
        return self.urls()

    async def attach(self, listener) -> None:
        """A Ray actor with ``set_engines(urls, fatal)`` (the rollout executor), told the engines serving now and
        then every change. The run has one executor at a time: one rebuilt after a trainer restart replaces the
        old, which is gone. Telling the current set here, not at the executor's construction, lets the executor
        start while the engines boot, and leaves no gap in which a change could go unheard."""
        self._listeners = [listener]
        await listener.set_engines.remote(self.serving_urls(), self._fatal)

    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _serving(self) -> list[int]:
        return self.supervisor.serving() if self.supervisor else list(range(len(self.engines)))

    def serving_urls(self) -> list[str]:
        return [self.engines[i].url for i in self._serving()]

    def engine_pids(self) -> list[int]:
        return [e.pid for e in self.engines if e.pid is not None]

    def placement(self) -> list[dict]:
        """Where each engine's server runs: node, address and the GPUs it was given (``placement.where``)."""
        return [e.where for e in self.engines]

    def all_engine_pids(self) -> list[int]:
        """Every engine process ever started, restarted ones included."""
        return list(self.started_pids)

    def _record_started(self) -> None:
        """Adds the engines' server processes not yet recorded: a start's, and, once it is healthy, those of its
        starts again after a port clash (``EngineProcess.wait_healthy``)."""
        self.started_pids.extend(p for e in self.engines for p in e.pids if p not in self.started_pids)

    def pid(self) -> int:
        return os.getpid()

    def health_metrics(self) -> dict[str, float]:
        return self.supervisor.metrics() if self.supervisor else {}

    # -- fault tolerance I/O -----------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            try:
                await self.supervisor.tick()
            except AllEnginesFailed as e:
                self._fatal = str(e)
                logger.error("%s", e)
                await self._notify([], self._fatal)
                return
            except Exception:  # noqa: BLE001 - a broken round must not end health checking
                logger.exception("health check round failed")
            await asyncio.sleep(self.cfg.fault_tolerance.health_check_interval)

    async def _probe(self, i: int) -> tuple[Probe, str]:
        e = self.engines[i]
        alive, code = await e.state()
        if not alive:
            self._tails[i] = await e.tail_log(15)
            return Probe.DEAD, f"process {e.pid} exited with code {code}"
        timeout = self.cfg.fault_tolerance.health_check_timeout
        asked = time.monotonic()
        if await self.clients[i].health(timeout=timeout):
            return Probe.OK, ""
        # A refused or reset check (not a silent one: a hung server lets it time out) is a server going away: a
        # killed one closes its socket before its process is reaped, which on a loaded machine took over a second
        # (its threads ending). A process that exits meanwhile is dead, not unhealthy, and its exit code says why.
        deadline = time.monotonic() + (EXIT_GRACE_S if time.monotonic() - asked < timeout else 0.0)
        while alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            alive, code = await e.state()
        self._tails[i] = await e.tail_log(15)
        if not alive:
            return Probe.DEAD, f"process {e.pid} exited with code {code}"
        return Probe.FAILED, f"/health did not answer 200 within {timeout:.1f}s (--rollout-health-check-timeout)"

    def _describe(self, i: int) -> str:
        e = self.engines[i]
        return f"{e.url}, log {e.log_path}:\n{self._tails[i]}" if e.log_path else e.url

    async def _restart(self, i: int) -> None:
        """Replace engine i by a fresh process (new port) holding the current weights; raises on failure."""
        e = self.engines[i]
        await e.stop(1.0)  # kills a hung one; nothing to do for a dead one
        await self.clients[i].close()
        self._busy_offset[i] += self._busy_last[i]
        self._busy_last[i] = 0.0
        await e.start()  # a new server (new port) on the same node and GPUs
        self._record_started()
        await e.wait_healthy(self.cfg.startup_timeout)
        self._record_started()
        self.clients[i] = make_client(self.cfg.backend, e.url, self.cfg.request_timeout, self.cfg.api_key)
        await self._seed(i)

    async def _seed(self, i: int) -> None:
        from miles_async.weights.http import push_buckets
        from miles_async.weights.source import iter_buckets

        async with self._weights_lock:  # no update in flight: every serving engine holds the current version
            peers = [j for j in self._serving() if j != i]
            if not peers:
                raise RuntimeError("no serving engine to copy the current weights from")
            peer = peers[0]
            tensors, version = await self.clients[peer].get_weights()
            buckets = iter_buckets(tensors.items(), next(iter(tensors.values())).dtype, SEED_BUCKET_BYTES)
            await push_buckets(
                buckets, [self.engines[i].url], version, self.cfg.request_timeout, api_key=self.cfg.api_key
            )
            got = int((await self.clients[i].model_info())["weight_version"])
            if got != version:
                raise RuntimeError(f"engine {i} reports weight version {got} after being given version {version}")
            if self.cfg.check_weight_update_equal:
                mismatch = first_mismatch(
                    (await self.clients[peer].weights_checksum())["checksums"],
                    (await self.clients[i].weights_checksum())["checksums"],
                )
                if mismatch:
                    raise RuntimeError(
                        f"--check-weight-update-equal: restarted engine {i} does not hold engine "
                        f"{peer}'s weights: {mismatch}"
                    )
        logger.warning(
            "engine %d restarted: pid %d at %s, weight version %d copied from engine %d",
            i,
            self.engines[i].pid,
            self.engines[i].url,
            version,
            peer,
        )

    async def _on_serving_changed(self, serving: list[int]) -> None:
        await self._notify([self.engines[i].url for i in serving], None)

    async def _notify(self, urls: list[str], fatal: str | None) -> None:
        for listener in self._listeners:
            try:
                await listener.set_engines.remote(urls, fatal)
            except Exception as e:  # noqa: BLE001 - a gone listener must not stop health checking
                logger.warning("could not tell %s about the engines: %r", listener, e)

    # -- calls on every serving engine ---------------------------------------------------------
    async def _check_alive(self) -> None:
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        if self.supervisor is not None:
            if self.supervisor.failed is not None:
                raise RuntimeError(str(self.supervisor.failed))
            return
        for e, (alive, code) in zip(self.engines, await asyncio.gather(*[e.state() for e in self.engines])):
            if not alive:
                raise RuntimeError(
                    f"engine {e.index} ({e.url}) died with code {code}; last log lines:\n{await e.tail_log(30)}"
                )

    async def _each(self, method: str, *args) -> dict[int, object]:
        """Call ``method`` on every serving engine. With fault tolerance an engine that fails the call is
        reported to the supervisor and left out of the answer instead of failing it."""
        await self._check_alive()
        idx = self._serving()
        results = await asyncio.gather(
            *[getattr(self.clients[i], method)(*args) for i in idx], return_exceptions=self.supervisor is not None
        )
        out = {}
        for i, r in zip(idx, results):
            if isinstance(r, BaseException):
                if not (isinstance(r, EngineError) and is_engine_failure(r)):
                    raise r
                self.supervisor.report_failure(i, str(r), certain=not (await self.engines[i].state())[0])
                continue
            out[i] = r
        if self.supervisor is not None:
            await self.supervisor.publish()
        return out

    async def _all(self, method: str, *args) -> list:
        return list((await self._each(method, *args)).values())

    async def pause(self, mode: str = "in_place") -> None:
        await self._all("pause", mode)

    async def resume(self) -> None:
        await self._all("resume")

    async def begin_weight_update(self, mode: str = "in_place") -> list[str]:
        """Pause the serving engines for a weight update and return their URLs (the ones to push to).

        Until ``end_weight_update``, no restarted engine is seeded (so none misses the update)."""
        await self._weights_lock.acquire()
        try:
            await self._all("pause", mode)
        except BaseException:
            self._weights_lock.release()
            raise
        return self.serving_urls()

    async def end_weight_update(self) -> None:
        try:
            await self._all("resume")
        finally:
            if self._weights_lock.locked():
                self._weights_lock.release()

    async def flush_cache(self) -> None:
        await self._all("flush_cache")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self._all("update_weights_from_disk", model_path, weight_version)

    async def weight_versions(self) -> list[int]:
        infos = await self._all("model_info")
        return [int(i["weight_version"]) for i in infos]

    async def weights_checksums(self) -> dict[str, dict]:
        """{engine URL: per-tensor checksums} of the serving engines (``--check-weight-update-equal``)."""
        answers = await self._each("weights_checksum")
        return {self.engines[i].url: a["checksums"] for i, a in answers.items()}

    async def busy_seconds(self) -> float:
        """Seconds all engines together spent in forward passes since the run started (restarts included)."""
        for i, load in (await self._each("load")).items():
            self._busy_last[i] = float(load.get("busy_seconds", 0.0))
        return sum(self._busy_offset) + sum(self._busy_last)

    async def dispose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.supervisor is not None:
            await self.supervisor.close()
        for c in self.clients:
            await c.close()
        await asyncio.gather(*[e.close() for e in self.engines])
