"""SGLang's environment for the engine tests: built once by scripts/setup_sglang_env.sh, then cached.

On a fresh machine the first run installs it (minutes, ~3 GB). If that fails, every test that needs
it FAILS with the install log's tail; they are skipped only when MILES_ASYNC_SKIP_SGLANG=1 is set.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/engines/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    if os.environ.get("MILES_ASYNC_SKIP_SGLANG") == "1":
        pytest.skip("MILES_ASYNC_SKIP_SGLANG=1")
    try:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup_sglang_env.sh")], capture_output=True,
                              text=True, timeout=1500)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"scripts/setup_sglang_env.sh did not finish in {e.timeout:.0f}s:\n{(e.stderr or b'')[-4000:]}",
                    pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"scripts/setup_sglang_env.sh failed (exit {proc.returncode}); set MILES_ASYNC_SKIP_SGLANG=1 to "
                    f"skip the SGLang tests on purpose.\n{proc.stderr[-4000:]}", pytrace=False)
    venv = proc.stdout.strip().splitlines()[-1]
    python = Path(venv) / "bin" / "python"
    assert python.exists(), f"setup_sglang_env.sh printed {venv!r}, which has no bin/python"
    return str(python)
