"""What each ``--rollout-backend`` is to the configuration: the weight routes it can load, and the interpreter
that runs it.

The engines' declarations that flags and checks read: ``capabilities.py`` validates ``--weight-update-method``
against ``weight_routes`` (its ``auto`` takes the first), ``engine.py`` checks the interpreter under
--check-config. ``inference/engines.py`` joins each kind to its client and launcher. The configuration imports
nothing of ``inference/``; ``inference/`` imports the configuration.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from miles_async.utils.cache import cache_dir


@dataclass(frozen=True)
class EngineKind:
    name: str  # the --rollout-backend value
    # The --weight-update-method values it can load: "tensor" (buckets over HTTP, in the engine's format),
    # "disk" (an HF folder it reloads), "distributed" (an NCCL/gloo broadcast from the trainer's rank 0).
    weight_routes: tuple[str, ...]
    # The trainer-side module (miles_async.weights) of its "tensor" route: "http" (the bytes over HTTP) or
    # "shared_memory" (handles to the trainer's memory, for an engine on the trainer's node: CUDA IPC handles
    # when the trainer's weights are on a GPU, shared-memory files when on the CPU; for the embedded engine, a
    # /dev/shm staging buffer it maps, with the bytes over HTTP to an engine on another node).
    tensor_route: str = "http"


ENGINE_KINDS: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind("embedded", weight_routes=("tensor",), tensor_route="shared_memory"),
        EngineKind("sglang", weight_routes=("distributed", "disk", "tensor"), tensor_route="shared_memory"),
        EngineKind("vllm", weight_routes=("disk",)),
    )
}


def engine_python(engine: str, explicit: str | None) -> str:
    """The interpreter that runs ``engine`` ("sglang", "vllm"): --<engine>-python, $MILES_ASYNC_<ENGINE>_PYTHON,
    the engine's cached environment (scripts/setup_<engine>_env.sh), or (last) this one."""
    if explicit:
        return explicit
    if os.environ.get(f"MILES_ASYNC_{engine.upper()}_PYTHON"):
        return os.environ[f"MILES_ASYNC_{engine.upper()}_PYTHON"]
    cached = cache_dir() / f"venv-{engine}" / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable
