"""Shared fixtures (tiny random models and task data built offline, once per session), each test's time cap,
CI's skip policy, and the engines' environments built before the tests that need them."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ray_cluster
from tests.budget import Budget, allowed_skips, skip_allowed
from tests.engine_envs import ENGINES, prepare

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from miles_async.assets.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny random Qwen2-VL with its processor (miles_async/assets/tiny_vlm.py)."""
    from miles_async.assets.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_2_5(tmp_path_factory) -> Path:
    """The tiny VLM in Qwen2.5-VL's layout (windowed vision attention), with the same tokenizer and processor."""
    from miles_async.assets.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_2_5"), seed=0, arch="qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_vlm_3(tmp_path_factory) -> Path:
    """The tiny VLM in Qwen3-VL's layout (learned vision positions, deepstack), with the same tokenizer."""
    from miles_async.assets.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_3"), seed=0, arch="qwen3_vl")


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory) -> tuple[Path, Path]:
    from miles_async.assets.tiny_model import make_tiny_task_dataset

    return make_tiny_task_dataset(tmp_path_factory.mktemp("tiny_task"), n_train=64, n_eval=16, seed=0)


@pytest.fixture(scope="session")
def quickstart_from_an_empty_cache(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """README command 1's asset steps (``quickstart.sh --dry-run``) on an empty cache, as a fresh machine runs
    them: the SmolLM2 wheel downloaded and converted, the data written (only the venv reused). Once per session,
    whichever test worker asks first (the others wait on its lock): its converted SmolLM2 serves every test of
    the real model."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's own
    cache, result = shared / "empty_cache", shared / "empty_cache.json"
    with open(shared / "empty_cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            cache.mkdir()
            env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MODEL", "DATA", "OUT")}
            env.update(MILES_ASYNC_CACHE=str(cache), MILES_ASYNC_VENV=sys.prefix, OUT=str(cache / "run"))
            proc = subprocess.run(
                ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--dry-run"],
                env=env,
                cwd=cache,
                capture_output=True,
                text=True,
                timeout=560,
            )
            result.write_text(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))
    done = json.loads(result.read_text())
    proc = subprocess.CompletedProcess(["quickstart.sh", "--dry-run"], **done)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return cache, proc


@pytest.fixture(scope="session")
def smollm2(quickstart_from_an_empty_cache) -> Path:
    """The real SmolLM2-135M-Instruct, converted from its wheel this session."""
    from miles_async.assets import smollm2 as assets

    return assets.model_dir(quickstart_from_an_empty_cache[0])


@pytest.fixture
def refused_port():
    """A 127.0.0.1 port that refuses connections for the test's length, and that no other process can take
    (tests/ports.py)."""
    from tests.ports import refused_port

    with refused_port() as port:
        yield port


# ---- the time budget and the skip policy (tests/budget.py, tests/budget.toml, tests/allowed_skips.toml) ----

_BUDGET = Budget.load()
_ALLOWED_SKIPS = allowed_skips()
_CI = os.environ.get("CI") == "true"


def pytest_collection_modifyitems(config, items):
    """Each test gets its cap as a timeout (fixture set-up included) and the slow list's tests the `slow` mark."""
    stale = _BUDGET.stale_entries()
    if stale:
        raise pytest.UsageError(f"tests/budget.toml names tests that do not exist: {stale}")
    # `--timeout N` on the command line (while debugging one test) replaces every cap; the slow marks stay.
    given = config.getoption("timeout", None)
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            raise pytest.UsageError(f"{item.nodeid} sets its own timeout: its cap belongs in tests/budget.toml")
        cap = _BUDGET.cap(item.nodeid)
        item.add_marker(pytest.mark.timeout(given if given is not None else cap.seconds))
        if cap.slow:
            item.add_marker(pytest.mark.slow)
    items[:] = longest_files_first(items, lambda item: _BUDGET.cap(item.nodeid))


def longest_files_first(items: list, cap_of) -> list:
    """Files whole, those with the longest caps first (ties: more slow tests first), the rest in their order.
    Two workers given files in collection order (--dist loadfile) otherwise meet the 3-minute rehearsal last
    and one idles while the other runs it."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(tests: list) -> tuple[float, float]:
        caps = [cap_of(t).seconds for t in tests if cap_of(t).slow]
        return (max(caps, default=0), sum(caps))

    order = sorted(files.values(), key=lambda tests: tuple(-w for w in weight(tests)))  # stable: ties keep order
    return [item for tests in order for item in tests]


def pytest_collection_finish(session):
    """The engines the selected tests run get their environments now, outside every test's cap; none for
    --collect-only, which runs no test (listing the tests must not start minutes of building)."""
    if session.config.option.collectonly:
        return
    engines = {e for e in ENGINES for item in session.items if item.get_closest_marker(e)}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    prepare(engines, report=(lambda line: reporter.write_line(line)) if reporter else print)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skip is a failure unless the test is a GPU one or tests/allowed_skips.toml names it."""
    outcome = yield
    rep = outcome.get_result()
    if not (_CI and rep.skipped) or hasattr(rep, "wasxfail"):
        return
    if skip_allowed(item.nodeid, item.get_closest_marker("gpu") is not None, _ALLOWED_SKIPS):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (
        f"skipped under CI=true ({reason}), which allows only GPU tests and those named in "
        f"tests/allowed_skips.toml with the reason this machine may lack what they need"
    )


def pytest_sessionfinish(session, exitstatus):
    ray_cluster.stop()  # the session's shared Ray cluster, if a test started it


@pytest.fixture(scope="module")
def shared_ray():
    """This test process joined to the session's Ray cluster (tests/ray_cluster.py) for one module: a tenth of a
    second, where a cluster of its own takes seconds to start and to stop."""
    import ray

    ray.init(address=ray_cluster.address(), logging_level="WARNING")
    yield
    ray.shutdown()
