"""The loop's and the API's shared handle: the state core plus what waits (a pause) and what acts on the engines.

The loop calls ``phase``, ``step_done``, ``take_commands``, ``hold_while_paused`` and ``reassert_pause``; the API
server calls ``pause``, ``resume``, ``stop`` and reads ``state``. Both run on the driver's one event loop, so
neither needs a thread lock; the asyncio lock only orders the engine calls of a pause against a resume.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from miles_async.control.state import ControlState, StepCommands

logger = logging.getLogger(__name__)


class EngineView(Protocol):
    """The inference engines as the control API sees them (``control.engines.ControllerEngines``)."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def states(self) -> dict: ...


class Control:
    def __init__(self, state: ControlState, engines: EngineView):
        self.state = state
        self.engines = engines
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._engine_calls = asyncio.Lock()

    # -- the loop's side ---------------------------------------------------------------------------
    def phase(self, name: str) -> None:
        self.state.set_phase(name)

    def step_done(self, step: int, metrics: dict) -> None:
        self.state.step_done(step, metrics)

    def take_commands(self) -> StepCommands:
        return self.state.take_commands()

    async def hold_while_paused(self) -> None:
        """At the step boundary, before the weights change: a paused run waits here until POST /resume or /stop.
        No deadline on purpose (an operator's pause lasts as long as they want); Ctrl-C and SIGTERM still cancel
        it. Without this hold, the next weight update's resume would silently undo the pause."""
        if self._resumed.is_set():
            return
        before = self.state.phase
        self.state.set_phase("paused")
        logger.info("paused by the control API after step %d: waiting for POST /resume or /stop", self.state.step)
        await self._resumed.wait()
        self.state.set_phase(before)

    async def reassert_pause(self) -> None:
        """After a weight update: its end resumes every engine, so a pause that came in during it is made again."""
        async with self._engine_calls:
            if self.state.paused:
                await self.engines.pause()

    # -- the API's side ------------------------------------------------------------------------
    async def pause(self) -> None:
        """Generation stops (engines paused in place: running requests keep their state) and the loop holds at
        its next step boundary. Idempotent. Raises (the state unchanged) if the engines cannot be paused."""
        async with self._engine_calls:
            if self.state.paused:
                return
            # Marked first, so a weight update that ends while the engines are being paused re-pauses them.
            self.state.paused = True
            self._resumed.clear()
            try:
                await self.engines.pause()
            except BaseException:
                self.state.paused = False
                self._resumed.set()
                raise
        logger.info("generation paused by the control API at step %d", self.state.step)

    async def resume(self) -> None:
        async with self._engine_calls:
            if not self.state.paused:
                return
            await self.engines.resume()
            self.state.paused = False
            self._resumed.set()
        logger.info("generation resumed by the control API at step %d", self.state.step)

    async def stop(self) -> None:
        """The run saves (with --save) and ends at its next step boundary. A paused run is resumed first, since
        that boundary may be waiting for a rollout."""
        self.state.request_stop()
        logger.info("stop requested by the control API at step %d", self.state.step)
        try:
            await self.resume()
        finally:
            self._resumed.set()  # even if the engines could not be resumed, the loop must not stay held
