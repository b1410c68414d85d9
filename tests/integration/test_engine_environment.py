"""No credential of the process that starts an engine reaches the engine server's environment, for every engine.

A run's driver holds the user's credentials (``WANDB_API_KEY``, ``HF_TOKEN``, the control API's token, cloud keys),
and the process that starts the engines may too: the Ray workers of a cluster the run joins were started by
whoever started that cluster. The guard is the launcher's (``EngineProcess.env``: this process's environment without
its credentials, docs/security.md), not the Ray workers' clean start. So here this test's process holds every
credential, starts each engine kind's real server as the inference controller does (``make_engines``,
``LocalEngine.start``), reads the server's environment from /proc/<pid>/environ right after it started, and stops
it before it loads anything (the model folder holds a config.json only). Tool and verifier workers:
tests/unit/test_tool_calls.py."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.arguments import parse_args
from miles_async.inference.auth import KEY_FILE_ENV
from miles_async.ray.engine_host import make_engines
from tests.credentials_helpers import assert_no_credentials, hold_credentials, proc_environ
from tests.engine_envs import engine_python
from tests.flag_helpers import minimal_flags

PASSED_ON = ("MILES_ASYNC_TEST_SETTING", "passed-on")  # no credential: the server gets it from its launcher's


BACKENDS = ["embedded", pytest.param("sglang", marks=pytest.mark.sglang), pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_server_gets_none_of_its_starters_credentials(backend, tmp_path, monkeypatch):
    hold_credentials(monkeypatch)
    monkeypatch.setenv(*PASSED_ON)
    python = [] if backend == "embedded" else [f"--{backend}-python", engine_python(backend)]
    flags = [*minimal_flags(tmp_path), "--num-rollout", "1", "--rollout-backend", backend, *python]
    [engine] = make_engines(parse_args(flags).engine, str(tmp_path), None)

    async def started_environment() -> tuple[dict[str, str], bool]:
        await engine.start()
        try:
            return proc_environ(engine.pid), engine.proc.alive()
        finally:
            await engine.close()

    env, alive = asyncio.run(started_environment())
    assert alive, "the server exited before its environment was read"
    # The server's own first environment, the launcher's: what it passes on and the key's file, not the key.
    assert env.get(PASSED_ON[0]) == PASSED_ON[1] and env[KEY_FILE_ENV].startswith("/")
    assert_no_credentials(env, f"the {backend} engine server")
