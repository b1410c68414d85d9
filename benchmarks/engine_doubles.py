"""Engine doubles for benchmarks, and for tests that need the same: the embedded engine with a set cost per step.

The engine server runs one when ``$MILES_ASYNC_ENGINE_CLASS`` names it (see
``miles_async.inference.embedded.server``); ``fixed_step_cost_env`` is the environment that makes a
``train_async.py`` run, or one engine process, run ``FixedStepCost``. Engines inherit the
environment of the process that starts them, and import the double from the checkout (PYTHONPATH).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.doubles_env import seconds_from_env
from miles_async.inference.embedded.engine import Engine
from miles_async.inference.embedded.server import ENGINE_CLASS_ENV

STEP_SECONDS_ENV = "MILES_ASYNC_ENGINE_STEP_SECONDS"


class FixedStepCost(Engine):
    """The embedded engine, except that every decode step first sleeps ``$MILES_ASYNC_ENGINE_STEP_SECONDS``.

    A set generation cost makes a benchmark's cost model hold on any machine, and makes pause and
    abort land mid-generation on a tiny model that would otherwise finish first. The cost is paid
    before the step's tokens are out, as compute would be: after the last step nothing waits.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.step_seconds = seconds_from_env(STEP_SECONDS_ENV, type(self).__name__, "each decode step takes")
        super().__init__(*args, **kwargs)

    def _decode_step(self) -> None:
        time.sleep(self.step_seconds)
        super()._decode_step()


def fixed_step_cost_env(seconds: float) -> dict[str, str]:
    """The environment variables that make every engine started under them a ``FixedStepCost`` of ``seconds``."""
    return {ENGINE_CLASS_ENV: f"{__name__}:{FixedStepCost.__name__}", STEP_SECONDS_ENV: str(seconds)}
