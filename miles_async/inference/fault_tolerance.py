"""Fault-tolerance policy for inference engines: detect, quarantine, restart with backoff, give up.

This module is pure policy. Time comes from an injected clock and every effect is an injected
async callable, so the policy is unit-tested with a fake clock and fake I/O, without sleeping
or processes; ``miles_async.ray.inference_controller`` supplies the real I/O (HTTP probes,
engine processes, weight copies) and calls ``tick()`` every ``--rollout-health-check-interval``.

Life of an engine::

    HEALTHY --probe fails--> SUSPECT --failure_threshold fails in a row--> QUARANTINED
       ^                        |  (a probe that succeeds clears it)          |
       |                        |                                             | backoff elapsed
       |   process exited: quarantined at once, whatever its state            v
       +---------------- restart + current weights succeeded ------------ RESTARTING
                                                                              |
               restart failed: QUARANTINED again, next try after the backoff  |
               restarts used up (--max-engine-restarts): GAVE_UP <-----------+

HEALTHY and SUSPECT engines take traffic ("serving"); the others get none. A restarted engine
serves again only once ``restart`` returned, i.e. once it holds the current weights. When no
engine serves any more the run cannot go on (a restart copies the weights from a serving
peer), and ``tick`` raises ``AllEnginesFailed`` naming each engine, its last error and log.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    RESTARTING = "restarting"
    GAVE_UP = "gave_up"


SERVING = (EngineState.HEALTHY, EngineState.SUSPECT)


class Probe(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"  # no answer in time, or an error status: may be transient
    DEAD = "dead"  # the process exited: certain


class AllEnginesFailed(RuntimeError):
    """No engine can serve any more; the run must stop."""


@dataclass(frozen=True)
class FaultTolerancePolicy:
    failure_threshold: int = 2  # failed probes in a row that quarantine a running engine
    max_restarts: int = 3  # restarts per engine over the run (--max-engine-restarts)
    backoff_base: float = 1.0  # seconds before the 2nd restart; doubles with each further one
    backoff_cap: float = 60.0

    def backoff(self, restarts_so_far: int) -> float:
        """Delay before the next restart of an engine restarted ``restarts_so_far`` times already."""
        if restarts_so_far <= 0:
            return 0.0
        return min(self.backoff_cap, self.backoff_base * 2 ** (restarts_so_far - 1))


@dataclass
class EngineHealth:
    index: int
    state: EngineState = EngineState.HEALTHY
    consecutive_failures: int = 0
    restarts: int = 0  # restart attempts so far, successful or not
    next_restart_at: float = 0.0
    last_error: str = ""


ProbeFn = Callable[[int], Awaitable[tuple[Probe, str]]]
RestartFn = Callable[[int], Awaitable[None]]
ChangeFn = Callable[[list[int]], Awaitable[None]]


class EngineSupervisor:
    """Tracks every engine's state and decides when to quarantine, restart or give up.

    ``probe(i)`` -> (Probe, detail): one health check, bounded in time by the caller.
    ``restart(i)``: stop what is left of engine i, start it again and give it the current
    weights; raises on failure. ``on_change(serving)``: the serving engines changed (the
    router must learn it). ``describe(i)``: text for error messages (e.g. its log tail).
    """

    def __init__(
        self,
        num_engines: int,
        policy: FaultTolerancePolicy,
        clock: Callable[[], float],
        probe: ProbeFn,
        restart: RestartFn,
        on_change: ChangeFn,
        describe: Callable[[int], str] = lambda i: "",
    ):
        if num_engines < 1:
            raise ValueError("EngineSupervisor needs at least one engine")
        self.policy = policy
        self.clock = clock
        self._probe = probe
        self._restart = restart
        self._on_change = on_change
        self._describe = describe
        self.engines = [EngineHealth(i) for i in range(num_engines)]
        self.restarts_total = 0
        self.restarts_succeeded = 0
        self.quarantines_total = 0
        self.failed: AllEnginesFailed | None = None
        self._recoveries: dict[int, asyncio.Task] = {}
        self._published = self.serving()

    # -- queries -----------------------------------------------------------------------------
    def serving(self) -> list[int]:
        return [h.index for h in self.engines if h.state in SERVING]

    def state(self, i: int) -> EngineState:
        return self.engines[i].state

    def metrics(self) -> dict[str, float]:
        count = {s: sum(h.state == s for h in self.engines) for s in EngineState}
        return {
            "engine/serving": float(len(self.serving())),
            "engine/quarantined": float(count[EngineState.QUARANTINED] + count[EngineState.RESTARTING]),
            "engine/gave_up": float(count[EngineState.GAVE_UP]),
            "engine/quarantines": float(self.quarantines_total),
            "engine/restarts": float(self.restarts_succeeded),
            "engine/restart_attempts": float(self.restarts_total),
        }

    # -- events ------------------------------------------------------------------------------
    async def tick(self) -> None:
        """One round: probe the serving engines, start the restarts that are due, publish changes.

        Restarts run in the background (``wait_recoveries`` awaits them), so a slow restart
        never delays the detection of another failure. Raises ``AllEnginesFailed`` once no
        engine serves.
        """
        self._raise_if_failed()
        serving = self.serving()
        results = await asyncio.gather(*[self._safe_probe(i) for i in serving])
        for i, (result, detail) in zip(serving, results):
            h = self.engines[i]
            if h.state not in SERVING:  # changed while we probed (a concurrent report)
                continue
            if result == Probe.OK:
                if h.state == EngineState.SUSPECT:
                    logger.warning("engine %d answers again", i)
                h.state, h.consecutive_failures = EngineState.HEALTHY, 0
            else:
                self.report_failure(i, detail, certain=result == Probe.DEAD)
        self._start_due_restarts()
        await self.publish()
        self._raise_if_failed()

    def report_failure(self, i: int, detail: str, certain: bool = False) -> None:
        """A probe or a call to engine i failed; ``certain``: it is known dead (process exited)."""
        h = self.engines[i]
        if h.state not in SERVING:
            return
        h.consecutive_failures += 1
        h.last_error = detail
        if certain or h.consecutive_failures >= self.policy.failure_threshold:
            self._quarantine(h)
        else:
            h.state = EngineState.SUSPECT
            logger.warning(
                "engine %d is suspect (%d/%d failed checks): %s",
                i,
                h.consecutive_failures,
                self.policy.failure_threshold,
                detail,
            )

    async def wait_recoveries(self) -> None:
        """Await the restarts in progress (tests; shutdown)."""
        while self._recoveries:
            await asyncio.gather(*list(self._recoveries.values()), return_exceptions=True)

    async def close(self) -> None:
        for task in self._recoveries.values():
            task.cancel()
        await asyncio.gather(*self._recoveries.values(), return_exceptions=True)
        self._recoveries.clear()

    # -- internals ---------------------------------------------------------------------------
    async def _safe_probe(self, i: int) -> tuple[Probe, str]:
        try:
            return await self._probe(i)
        except Exception as e:  # noqa: BLE001 - a probe that raises is a failed probe
            return Probe.FAILED, f"health check raised {type(e).__name__}: {e}"

    def _quarantine(self, h: EngineHealth) -> None:
        self.quarantines_total += 1
        self._after_failure(h)
        logger.warning(
            "engine %d quarantined (%s); %s",
            h.index,
            h.last_error,
            f"restart in {self.policy.backoff(h.restarts):.1f}s"
            if h.state == EngineState.QUARANTINED
            else "no restart left (--max-engine-restarts)",
        )

    def _after_failure(self, h: EngineHealth) -> None:
        """The engine is down: wait for its next restart, or give it up if none is left."""
        if h.restarts >= self.policy.max_restarts:
            h.state = EngineState.GAVE_UP
            logger.warning("engine %d given up after %d restart(s): %s", h.index, h.restarts, h.last_error)
        else:
            h.state = EngineState.QUARANTINED
            h.next_restart_at = self.clock() + self.policy.backoff(h.restarts)
        if not self.serving() and self.failed is None:
            self.failed = AllEnginesFailed(self._failure_report())

    def _start_due_restarts(self) -> None:
        if self.failed is not None:
            return
        now = self.clock()
        for h in self.engines:
            if h.state == EngineState.QUARANTINED and now >= h.next_restart_at and h.index not in self._recoveries:
                h.state = EngineState.RESTARTING
                h.restarts += 1
                self.restarts_total += 1
                self._recoveries[h.index] = asyncio.ensure_future(self._recover(h))

    async def _recover(self, h: EngineHealth) -> None:
        try:
            logger.warning("restarting engine %d (attempt %d of %d)", h.index, h.restarts, self.policy.max_restarts)
            await self._restart(h.index)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failed restart is retried or given up
            h.last_error = f"restart {h.restarts} failed: {type(e).__name__}: {e}"
            logger.warning("engine %d: %s", h.index, h.last_error)
            self._after_failure(h)
        else:
            h.state, h.consecutive_failures = EngineState.HEALTHY, 0
            self.restarts_succeeded += 1
            logger.warning("engine %d is back and serving (restart %d)", h.index, h.restarts)
        finally:
            self._recoveries.pop(h.index, None)
        await self.publish()

    async def publish(self) -> None:
        """Tell ``on_change`` if the serving engines changed since it was last told."""
        serving = self.serving()
        if serving != self._published:
            self._published = serving
            await self._on_change(serving)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _failure_report(self) -> str:
        lines = [
            "no inference engine is left serving (--use-fault-tolerance restarts an engine by copying "
            "the current weights from a serving one):"
        ]
        for h in self.engines:
            lines.append(
                f"  engine {h.index}: {h.state.value} after {h.restarts} restart(s); last error: {h.last_error or '-'}"
            )
            detail = self._describe(h.index)
            if detail:
                lines.append("    " + detail.replace("\n", "\n    "))
        return "\n".join(lines)
