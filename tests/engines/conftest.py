"""The real engines' tests: each runs once per engine, on the environment tests/engine_envs.py builds before the
first test (a failed build fails them; nothing skips them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine_envs import ENGINES
from tests.engine_envs import engine_python as _engine_python


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/engines/" in str(item.fspath).replace(os.sep, "/"):
            callspec = getattr(item, "callspec", None)
            # A module that runs one engine only names it (ENGINE); the others run each, as ``backend``'s params.
            default = getattr(item.module, "ENGINE", "sglang")
            item.add_marker(getattr(pytest.mark, callspec.params.get("backend", default) if callspec else default))


@pytest.fixture(scope="module", params=ENGINES)
def backend(request) -> str:
    """Each engine test runs once per real engine (module scope: one server of each at a time)."""
    return request.param


@pytest.fixture(scope="module")
def engine_python(backend) -> str:
    return _engine_python(backend)


@pytest.fixture(scope="session")
def tiny_model_hd32(tmp_path_factory) -> Path:
    """The tiny llama with head size 32 (vLLM's CPU attention has no kernel for the default 16)."""
    from miles_async.assets.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model_hd32"), seed=0, head_dim=32)
