"""``pytest --collect-only`` lists the tests and builds nothing: the root conftest builds the engines'
environments (minutes and gigabytes on a fresh machine) only for a run of their tests (tests/engine_envs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.scripts.helpers import ROOT


def test_collect_only_builds_no_engine_environment(tmp_path):
    """The engine environments point under a plain file, so a build that starts fails at once and says so
    ("engine environments: ... FAILED") instead of downloading anything."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    env = {
        **os.environ,
        "MILES_ASYNC_SGLANG_VENV": str(blocked / "venv-sglang"),
        "MILES_ASYNC_VLLM_VENV": str(blocked / "venv-vllm"),
    }
    # An engine module that imports little: its one test carries the vllm marker (tests/engines/conftest.py).
    args = ["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/engines/test_engine_train.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tests/engines/test_engine_train.py::test_train_async_with_a_real_engine" in proc.stdout
    assert "engine environments" not in proc.stdout + proc.stderr
