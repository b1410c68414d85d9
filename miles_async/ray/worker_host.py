"""The Ray actor a training worker runs in, so that the driver never imports the worker's class.

``ray.remote(cls)`` needs the class itself, and a backend's worker class imports torch, transformers and peft
(megatron-core too): 3-8 s of the driver's CPU at every start, in a process that never touches a tensor. The
driver makes this host instead and names the class by ``module:Class``; the host imports it in the worker's own
process, which needs it anyway, and runs on it each call the driver names.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from miles_async.utils.cpus import pin
from miles_async.utils.plugins import load_object

# The workers' concurrency group that writes background checkpoints (their other calls run one at a time).
CHECKPOINT_GROUP = "checkpoint"


class WorkerHost:
    def __init__(self, class_path: str, *args: Any, cpu_affinity: tuple[int, ...] | None = None) -> None:
        if cpu_affinity:  # before the class's imports, so torch's thread pool starts on these cores
            pin(cpu_affinity, "--train-cpu-affinity")
        self.worker = load_object(class_path, "training worker class")(*args)

    def run(self, method: str, *args: Any) -> Any:
        """``worker.method(*args)``."""
        return getattr(self.worker, method)(*args)

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def run_beside(self, method: str, *args: Any) -> Any:
        """``run`` on the checkpoint group's thread, beside the calls that train (a background save's write)."""
        return self.run(method, *args)

    def pid(self) -> int:
        return os.getpid()


def host_class(class_path: str) -> type:
    """A ``WorkerHost`` named as the worker's class, so Ray's process titles and log prefixes read as before
    (``ray::FSDPTrainActor``, ``(FSDPTrainActor pid=...)``) without importing it."""
    name = class_path.replace(":", ".").rpartition(".")[2]
    return type(name, (WorkerHost,), {"__doc__": f"Hosts {class_path} (see WorkerHost)."})
