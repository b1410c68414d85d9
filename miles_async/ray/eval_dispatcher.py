"""Background evals: a bounded number in flight, failures logged and skipped, drained at the end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class EvalDispatcher:
    def __init__(
        self,
        run_eval: Callable[[int], Awaitable[dict]],
        on_result: Callable[[int, dict], None],
        max_in_flight: int,
        timeout: float,
    ):
        self.run_eval = run_eval
        self.on_result = on_result
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.in_flight: list[asyncio.Task] = []
        self.failures = 0

    async def _run(self, rollout_id: int) -> None:
        try:
            metrics = await asyncio.wait_for(self.run_eval(rollout_id), self.timeout)
        except Exception as e:  # an eval must never take the run down with it
            self.failures += 1
            logger.error("eval at rollout %d failed and is skipped: %r", rollout_id, e)
            return
        self.on_result(rollout_id, metrics)

    async def dispatch(self, rollout_id: int) -> None:
        self.in_flight = [t for t in self.in_flight if not t.done()]
        while len(self.in_flight) >= self.max_in_flight:
            await self.in_flight.pop(0)
        self.in_flight.append(asyncio.create_task(self._run(rollout_id)))

    async def drain(self) -> None:
        while self.in_flight:
            await self.in_flight.pop(0)
