"""Background evals: a bounded number in flight, drained at the end. An eval that fails does not stop training,
but it fails the run at its end: the run exits non-zero, listing every failure, when more than
``--eval-failures-allowed`` failed (``check``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalFailure:
    rollout_id: int
    error: str


class EvalsFailed(RuntimeError):
    """More evals failed than --eval-failures-allowed; the message lists every failure."""


def _describe(error: Exception) -> str:
    """The error in one line of the summary: an actor's exception as raised there, not Ray's remote traceback."""
    cause = getattr(error, "cause", None)  # ray.exceptions.RayTaskError: the exception the actor raised
    error = cause if isinstance(cause, Exception) else error
    return f"{type(error).__name__}: {error}"


class EvalDispatcher:
    def __init__(
        self,
        run_eval: Callable[[int], Awaitable[dict]],
        on_result: Callable[[int, dict], None],
        max_in_flight: int,
        timeout: float,
        failures_allowed: int = 0,
    ):
        self.run_eval = run_eval
        self.on_result = on_result
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.failures_allowed = failures_allowed
        self.in_flight: list[asyncio.Task] = []
        self.failures: list[EvalFailure] = []

    async def _run(self, rollout_id: int) -> None:
        try:
            metrics = await asyncio.wait_for(self.run_eval(rollout_id), self.timeout)
        except TimeoutError:
            self._failed(rollout_id, f"took longer than {self.timeout:g} s (--rollout-timeout)")
            return
        except Exception as e:  # training goes on; the end of the run reports it (check)
            self._failed(rollout_id, _describe(e))
            return
        self.on_result(rollout_id, metrics)

    def _failed(self, rollout_id: int, error: str) -> None:
        self.failures.append(EvalFailure(rollout_id, error))
        over = len(self.failures) > self.failures_allowed
        logger.error(
            "eval at rollout %d failed (%d failed, --eval-failures-allowed %d%s): %s",
            rollout_id,
            len(self.failures),
            self.failures_allowed,
            ": the run will exit non-zero" if over else "",
            error,
        )

    async def dispatch(self, rollout_id: int) -> None:
        self.in_flight = [t for t in self.in_flight if not t.done()]
        while len(self.in_flight) >= self.max_in_flight:
            await self.in_flight.pop(0)
        self.in_flight.append(asyncio.create_task(self._run(rollout_id)))

    async def drain(self) -> None:
        while self.in_flight:
            await self.in_flight.pop(0)

    def summary(self) -> str:
        """Every failed eval, one per line ("" when none failed)."""
        if not self.failures:
            return ""
        lines = [f"{len(self.failures)} eval(s) failed (--eval-failures-allowed {self.failures_allowed}):"]
        lines += [f"  eval at rollout {f.rollout_id}: {f.error}" for f in self.failures]
        return "\n".join(lines)

    def check(self) -> None:
        """``EvalsFailed`` listing every failure when more failed than allowed."""
        if len(self.failures) > self.failures_allowed:
            raise EvalsFailed(self.summary())
