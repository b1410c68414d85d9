"""What each ``--rollout-backend`` is: its client, its launcher and the weight routes it can load.

One engine, one folder (``embedded/``, ``sglang/``, ``vllm/``), one line here. The base modules
(``client.py``, ``launcher.py``) know no engine; this module, above them and the engine folders,
is the only one that names them all. ``--weight-update-method`` is validated against
``weight_routes`` (its ``auto`` takes the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_async.inference.auth import ApiKey
from miles_async.inference.client import EngineClient
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.launcher import EngineProcess
from miles_async.inference.sglang.client import SGLangEngineClient
from miles_async.inference.sglang.launcher import SGLangEngineProcess
from miles_async.inference.vllm.client import VLLMEngineClient
from miles_async.inference.vllm.launcher import VLLMEngineProcess

if TYPE_CHECKING:
    from miles_async.config import EngineConfig  # an annotation only: config reads ENGINES


@dataclass(frozen=True)
class EngineSpec:
    name: str  # the --rollout-backend value
    client: type[EngineClient]
    launcher: type[EngineProcess]
    # The --weight-update-method values it can load: "tensor" (buckets over HTTP, in the engine's format),
    # "disk" (an HF folder it reloads), "distributed" (an NCCL/gloo broadcast from the trainer's rank 0).
    weight_routes: tuple[str, ...]
    # The trainer-side module (miles_async.weights) of its "tensor" route: "http" (the bytes over HTTP) or
    # "shared_memory" (handles to the trainer's memory, for an engine on the trainer's node: CUDA IPC handles
    # when the trainer's weights are on a GPU, shared-memory files when on the CPU; for the embedded engine, a
    # /dev/shm staging buffer it maps, with the bytes over HTTP to an engine on another node).
    tensor_route: str = "http"


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "embedded",
            EmbeddedEngineClient,
            EmbeddedEngineProcess,
            weight_routes=("tensor",),
            tensor_route="shared_memory",
        ),
        EngineSpec(
            "sglang",
            SGLangEngineClient,
            SGLangEngineProcess,
            weight_routes=("distributed", "disk", "tensor"),
            tensor_route="shared_memory",
        ),
        EngineSpec("vllm", VLLMEngineClient, VLLMEngineProcess, weight_routes=("disk",)),
    )
}


def engine_spec(backend: str) -> EngineSpec:
    if backend not in ENGINES:
        raise ValueError(f"--rollout-backend {backend} is not available (engines: {', '.join(ENGINES)})")
    return ENGINES[backend]


def make_client(backend: str, url: str, timeout: float, api_key: ApiKey | str | None = None) -> EngineClient:
    """The client for one engine of ``--rollout-backend``, sending ``api_key`` (``EngineConfig.api_key``)."""
    return engine_spec(backend).client(url, timeout=timeout, api_key=api_key)


def make_engine_process(cfg: EngineConfig, index: int, log_dir: str | None) -> EngineProcess:
    """The server process of engine ``index`` of ``cfg.backend`` (not started)."""
    return engine_spec(cfg.backend).launcher(cfg, index, log_dir)
