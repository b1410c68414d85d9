"""One weight update, as a record that travels from the driver to the trainer's ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_async.inference.engines import engine_spec
from miles_async.utils.api_key import ApiKey

if TYPE_CHECKING:  # the driver builds these records and needs no torch (it costs each run seconds to import)
    import torch

DTYPES = ("float32", "bfloat16")  # --rollout-dtype: names of torch dtypes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --rollout-dtype name (one of DTYPES)."""
    import torch

    return getattr(torch, name)


# The routes, one module each; a --weight-update-method value names one, except "tensor", whose module is
# the engine's (EngineKind.tensor_route, config/engine_kinds.py).
HTTP, SHARED_MEMORY, DISK, PROCESS_GROUP = "http", "shared_memory", "disk", "process_group"
ROUTES = (HTTP, SHARED_MEMORY, DISK, PROCESS_GROUP)


def route_for(method: str, engine: str) -> str:
    """The route module of ``--weight-update-method method`` into ``--rollout-backend engine``."""
    if method == "tensor":
        return engine_spec(engine).kind.tensor_route
    if method == "disk":
        return DISK
    if method == "distributed":
        return PROCESS_GROUP
    raise ValueError(f"--weight-update-method {method!r}: expected tensor, disk or distributed")


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    route: str  # one of ROUTES
    dtype: str  # the engines' dtype (--rollout-dtype), a key of DTYPES
    timeout: float  # seconds, each engine call and each collective
    targets: tuple[str, ...] = ()  # engine URLs; the disk route's engines are the controller's
    engine: str = "embedded"  # --rollout-backend: whose client speaks to the targets
    bucket_bytes: int = 512 << 20  # --update-weight-buffer-size
    ranks_per_engine: int = 1  # the process group route: each engine's tensor-parallel ranks
    folder: str | None = None  # the disk route: where the HF folder goes
    # The engines drop their prefix cache with the last bucket. Not under --pause-generation-mode in_place:
    # the paused requests keep their KV (that mode's point) and SGLang refuses a flush while any is held.
    flush_cache: bool = True
    api_key: ApiKey | None = None  # the engines' key (EngineConfig.api_key), sent with every call to them
    # The shared-memory route into an engine that stages (the embedded engine): only write the update and have
    # the engines on this node map it, while they still generate; the driver commits it once they are paused.
    stage_only: bool = False

    def __post_init__(self):
        if self.route not in ROUTES:
            raise ValueError(f"weight route {self.route!r}: expected one of {ROUTES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--rollout-dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.route == DISK and not self.folder:
            raise ValueError("the disk weight route needs the folder to write")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)
