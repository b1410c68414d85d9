"""The engines as the control API sees them, read from and acted on through the inference controller actor."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_async.utils.async_utils import wait_for


class ControllerEngines:
    """``controller``: the inference controller's Ray actor handle (``Run.controller``); every call has a deadline,
    so a busy or dead controller makes /status report an error instead of hanging it."""

    def __init__(self, controller: Any, timeout: float):
        self.controller = controller
        self.timeout = timeout

    async def pause(self) -> None:
        # in_place: running requests keep their KV cache and go on where they stopped on resume.
        await wait_for(self.controller.pause.remote("in_place"), self.timeout, "the engines to pause")

    async def resume(self) -> None:
        await wait_for(self.controller.resume.remote(), self.timeout, "the engines to resume")

    async def states(self) -> dict:
        """Each engine serving or quarantined (out of the router: failed, restarting or given up on), the two
        counts, and the fault-tolerance counters when --use-fault-tolerance runs a supervisor."""
        urls, serving, health = await wait_for(
            asyncio.gather(
                self.controller.urls.remote(),
                self.controller.serving_urls.remote(),
                self.controller.health_metrics.remote(),
            ),
            self.timeout,
            "the inference controller's engine states",
        )
        up = set(serving)
        states = ["serving" if url in up else "quarantined" for url in urls]
        return {
            "engines": [{"index": i, "url": url, "state": st} for i, (url, st) in enumerate(zip(urls, states))],
            "serving": states.count("serving"),
            "quarantined": states.count("quarantined"),
            "health": health,
        }
