"""Shared fixtures: tiny random models and task data built offline, once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from miles_async.assets.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory) -> tuple[Path, Path]:
    from miles_async.assets.tiny_model import make_tiny_task_dataset

    return make_tiny_task_dataset(tmp_path_factory.mktemp("tiny_task"), n_train=64, n_eval=16, seed=0)


@pytest.fixture
def refused_port():
    """A 127.0.0.1 port that refuses connections for the test's length, and that no other process can take
    (tests/ports.py)."""
    from tests.ports import refused_port

    with refused_port() as port:
        yield port
