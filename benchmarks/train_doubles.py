"""Trainer doubles for benchmarks: the torch policy worker with a set cost per training step.

``train_async.py`` runs one as its actor when ``$MILES_ASYNC_ACTOR_CLASS`` names it (see
``miles_async.ray.train_group``); ``fixed_train_cost_env`` is the environment that does so. Ray's workers
inherit the environment of the run that starts them and import the double from the checkout (PYTHONPATH).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from benchmarks.doubles_env import seconds_from_env
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.ray.train_group import ACTOR_CLASS_ENV

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch

TRAIN_SECONDS_ENV = "MILES_ASYNC_TRAIN_SECONDS"


class FixedTrainCost(FSDPTrainActor):
    """The torch policy worker, except that training a rollout is a sleep of ``$MILES_ASYNC_TRAIN_SECONDS``:
    the batch still reaches every worker, the weights stay as they are (and are still pushed)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.train_seconds = seconds_from_env(TRAIN_SECONDS_ENV, type(self).__name__, "each training step takes")
        super().__init__(*args, **kwargs)

    def train(
        self, rollout_id: int, batch: RolloutBatch, temperature: float = 1.0, values: list[list[float]] | None = None
    ) -> dict:
        t0 = time.time()
        time.sleep(self.train_seconds)
        return {"train/seconds": time.time() - t0, "train/started_at": t0, "train/finished_at": time.time()}


def fixed_train_cost_env(seconds: float) -> dict[str, str]:
    """The environment variables that make a run's actor a ``FixedTrainCost`` of ``seconds`` per step."""
    return {ACTOR_CLASS_ENV: f"{__name__}:{FixedTrainCost.__name__}", TRAIN_SECONDS_ENV: str(seconds)}
