"""What each ``--rollout-backend`` runs: its client and its launcher, joined to what the configuration knows of it.

One engine, one folder (``embedded/``, ``sglang/``, ``vllm/``), one line here and one kind in
``config/engine_kinds.py`` (its weight routes, which ``--weight-update-method`` is validated against). The base
modules (``client.py``, ``launcher.py``) know no engine; this module, above them and the engine folders, is the
only one that names them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_async.config.engine import EngineConfig
from miles_async.config.engine_kinds import ENGINE_KINDS, EngineKind
from miles_async.inference.client import EngineClient
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.launcher import EngineProcess
from miles_async.inference.sglang.client import SGLangEngineClient
from miles_async.inference.sglang.launcher import SGLangEngineProcess
from miles_async.inference.vllm.client import VLLMEngineClient
from miles_async.inference.vllm.launcher import VLLMEngineProcess
from miles_async.utils.api_key import ApiKey


@dataclass(frozen=True)
class EngineSpec:
    kind: EngineKind  # its weight routes (config/engine_kinds.py)
    client: type[EngineClient]
    launcher: type[EngineProcess]


_PARTS: dict[str, tuple[type[EngineClient], type[EngineProcess]]] = {
    "embedded": (EmbeddedEngineClient, EmbeddedEngineProcess),
    "sglang": (SGLangEngineClient, SGLangEngineProcess),
    "vllm": (VLLMEngineClient, VLLMEngineProcess),
}
# Every kind the configuration accepts has its parts here (a kind without them fails this import, naming it).
ENGINES: dict[str, EngineSpec] = {name: EngineSpec(kind, *_PARTS[name]) for name, kind in ENGINE_KINDS.items()}


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
