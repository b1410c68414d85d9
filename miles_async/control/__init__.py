"""A running train_async.py's control API (status, save, pause, resume, stop) and Prometheus metrics.

``state`` is the pure core (phase, step, gauges, pending commands); ``control`` the handle the loop and the
server share; ``engines`` reads and pauses the engines through the inference controller; ``metrics`` renders
/metrics; ``server`` is the aiohttp server. ``control_api`` wires them for one run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from miles_async.config import Config
from miles_async.control.control import Control
from miles_async.control.engines import ControllerEngines
from miles_async.control.server import ControlServer
from miles_async.control.state import PHASES, ControlState

__all__ = ["PHASES", "Control", "control_api"]

# A pause returns once each engine finished its current decode step; /status must not hang on a busy controller.
ENGINE_CALL_TIMEOUT = 30.0


@asynccontextmanager
async def control_api(cfg: Config, run: Any) -> AsyncIterator[Control]:
    """The run's ``Control``, served over HTTP while inside when --api-server-port is given. ``run``: the entered
    ``Run`` (its ``controller`` actor handle)."""
    state = ControlState(time.monotonic, can_save=cfg.checkpoint.save is not None, start_step=cfg.loop.start_rollout_id)
    control = Control(state, ControllerEngines(run.controller, timeout=ENGINE_CALL_TIMEOUT))
    api = cfg.control
    if api is None or not api.enabled:
        yield control
        return
    server = ControlServer(control, api, cfg.tracking.output_dir, cfg.checkpoint.save, cfg.loop.num_rollout)
    await server.start()
    try:
        yield control
    finally:
        await server.close()
