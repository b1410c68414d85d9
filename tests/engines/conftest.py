"""The engines' own environments for the engine tests: built once by scripts/setup_<engine>_env.sh, then cached.

On a fresh machine the first run installs each (minutes, gigabytes). If that fails, every test that needs
it FAILS with the install log's tail; they are skipped only when MILES_ASYNC_SKIP_<ENGINE>=1 is set
(MILES_ASYNC_SKIP_SGLANG, MILES_ASYNC_SKIP_VLLM).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


ENGINES = ("sglang", "vllm")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/engines/" in str(item.fspath).replace(os.sep, "/"):
            callspec = getattr(item, "callspec", None)
            item.add_marker(getattr(pytest.mark, callspec.params.get("backend", "sglang") if callspec else "sglang"))


@pytest.fixture(scope="module", params=ENGINES)
def backend(request) -> str:
    """Each engine test runs once per real engine (module scope: one server of each at a time)."""
    return request.param


@pytest.fixture(scope="module")
def engine_python(backend) -> str:
    return _engine_python(backend)


def _engine_python(engine: str) -> str:
    skip = f"MILES_ASYNC_SKIP_{engine.upper()}"
    if os.environ.get(skip) == "1":
        pytest.skip(f"{skip}=1")
    script = ROOT / "scripts" / f"setup_{engine}_env.sh"
    try:
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1500)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script.name} did not finish in {e.timeout:.0f}s:\n{(e.stderr or b'')[-4000:]}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(
            f"{script.name} failed (exit {proc.returncode}); set {skip}=1 to skip the {engine} tests on "
            f"purpose.\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    venv = proc.stdout.strip().splitlines()[-1]
    python = Path(venv) / "bin" / "python"
    assert python.exists(), f"{script.name} printed {venv!r}, which has no bin/python"
    return str(python)


@pytest.fixture(scope="session")
def tiny_model_hd32(tmp_path_factory) -> Path:
    """The tiny llama with head size 32 (vLLM's CPU attention has no kernel for the default 16)."""
    from miles_async.assets.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model_hd32"), seed=0, head_dim=32)
