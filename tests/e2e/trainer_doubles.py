"""A policy worker that stalls in one method, so a test can kill a training rank at a known place.

``train_async.py`` runs it as its actor when ``$MILES_ASYNC_ACTOR_CLASS`` names it (``stall_env``); Ray's
workers import it from the checkout (PYTHONPATH). The first call of ``$MILES_ASYNC_TEST_STALL_METHOD`` (train,
push_weights or save) writes ``<method>_rank<r>`` (holding the worker's pid) into ``$MILES_ASYNC_TEST_MARK_DIR``;
then rank 1 sleeps (the test kills it there) while rank 0 enters a barrier of the group's gloo process group
with rank 1, which never comes: rank 0 is blocked in a collective with the rank that dies.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.ray.train_group import ACTOR_CLASS_ENV

METHOD_ENV = "MILES_ASYNC_TEST_STALL_METHOD"
MARK_DIR_ENV = "MILES_ASYNC_TEST_MARK_DIR"


class StallsInOneMethod(FSDPTrainActor):
    def _stall(self, method: str) -> None:
        if os.environ[METHOD_ENV] != method or getattr(self, "_stalled", False):
            return
        self._stalled = True
        Path(os.environ[MARK_DIR_ENV], f"{method}_rank{self.rank}").write_text(str(os.getpid()))
        if self.rank == 0:
            import torch.distributed as dist

            dist.barrier()
        else:
            time.sleep(3600)

    def train(self, *args: Any, **kwargs: Any) -> dict:
        self._stall("train")
        return super().train(*args, **kwargs)

    def push_weights(self, *args: Any, **kwargs: Any) -> dict:
        self._stall("push_weights")
        return super().push_weights(*args, **kwargs)

    def save(self, *args: Any, **kwargs: Any) -> None:
        self._stall("save")
        return super().save(*args, **kwargs)


def stall_env(method: str, mark_dir: Path) -> dict[str, str]:
    return {
        ACTOR_CLASS_ENV: f"{__name__}:{StallsInOneMethod.__name__}",
        METHOD_ENV: method,
        MARK_DIR_ENV: str(mark_dir),
    }
