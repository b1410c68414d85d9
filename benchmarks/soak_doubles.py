"""A trainer double for the fault-injection soak (``benchmarks/soak.py``): the torch policy worker, except that each
checkpoint write pauses after the worker wrote its part, so a save stays in progress long enough for a kill to land
inside it.

``train_async.py`` runs it as its actor when ``$MILES_ASYNC_ACTOR_CLASS`` names it (``miles_async.ray.train_group``),
the product's own plugin point; nothing in the product sleeps.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.doubles_env import seconds_from_env
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.ray.train_group import ACTOR_CLASS_ENV

SAVE_PAUSE_ENV = "MILES_ASYNC_SAVE_PAUSE_SECONDS"


class PausedSave(FSDPTrainActor):
    """Writes its checkpoint part as the torch worker does, then holds for ``$MILES_ASYNC_SAVE_PAUSE_SECONDS``: the
    iteration folder then has this worker's files but not the COMPLETE marker (``Run.save`` writes it after every
    part is on disk). The pause follows the write wherever it happens: in ``save`` (a blocking save) or in
    ``write_checkpoint`` (--async-save writes in the background)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.save_pause = seconds_from_env(SAVE_PAUSE_ENV, type(self).__name__, "each save pauses after its part")
        self._paused = False
        super().__init__(*args, **kwargs)

    def _pause(self) -> None:
        self._paused = True
        time.sleep(self.save_pause)

    def save(self, *args: Any, **kwargs: Any) -> Any:
        self._paused = False
        result = super().save(*args, **kwargs)
        if not self._paused and getattr(self, "_unwritten", None) is None:  # written now, not left for later
            self._pause()
        return result

    def write_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(self, "_unwritten", None) is not None
        result = super().write_checkpoint(*args, **kwargs)
        if pending:
            self._pause()
        return result


def paused_save_env(seconds: float) -> dict[str, str]:
    """The environment variables that make a run's actor a ``PausedSave`` holding each save ``seconds``."""
    return {ACTOR_CLASS_ENV: f"{__name__}:{PausedSave.__name__}", SAVE_PAUSE_ENV: str(seconds)}
