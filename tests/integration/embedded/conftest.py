from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.embedded.helpers import ServerProc, save_model


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Any:
    # Reference forwards here are tiny; with the servers competing for the
    # same 2 cores, multi-threaded OpenMP only adds spin-wait contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedded_models")
    return {
        "base": save_model(root / "base", seed=0),
        "alt": save_model(root / "alt", seed=1),
        "alt2": save_model(root / "alt2", seed=2),
    }


@pytest.fixture(scope="package")
def server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for the package's tests; a test that changes its weights restores the base ones. It runs with
    --port 0: the tests reach it on the port its log line says it got."""
    srv = ServerProc(model_dirs["base"], tmp_path_factory.mktemp("logs") / "server.log", port=0)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
