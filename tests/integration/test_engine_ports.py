"""Engine servers and their ports (inference/launcher.py): a server that takes its port on its command line, as
SGLang and vLLM do, is started again on a fresh port when its port was taken, the logs saying why, and only then;
the embedded engine listens on the socket its launcher bound, which no other process can take meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import socket
import sys
from pathlib import Path

import pytest
import requests

from miles_async.config import EngineConfig
from miles_async.config.engine_kinds import EngineKind
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.engines import ENGINES, EngineSpec
from miles_async.inference.launcher import EngineProcess, EngineStartError
from miles_async.ray.inference_controller import InferenceController
from miles_async.utils.api_key import new_api_key
from miles_async.utils.ports import PORT_ATTEMPTS


def _cfg(model_path: str) -> EngineConfig:
    return EngineConfig(
        backend="embedded",
        model_path=model_path,
        num_engines=1,
        dtype="float32",
        max_running_requests=4,
        num_threads=1,
        host="127.0.0.1",
        startup_timeout=60.0,
        request_timeout=30.0,
        seed=0,
        api_key=new_api_key(),
    )


class HttpServer(EngineProcess):
    """A real server that takes its port on its command line and fails on a taken one, as SGLang and vLLM do:
    Python's http.server, serving a folder whose ``health`` file makes /health answer 200. Its ports come from
    ``picks`` while there are any (the launcher's picker, injected), then free ones."""

    def __init__(self, root: Path, picks: list[int]):
        self.root, self.picks, self.starts = root, list(picks), 0
        super().__init__(_cfg(str(root)), 0, str(root / "logs"))

    def pick_port(self) -> int:
        return self.picks.pop(0) if self.picks else super().pick_port()

    def start(self) -> None:
        self.starts += 1
        super().start()

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "http.server",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--directory",
            str(self.root),
        ]


class BrokenServer(HttpServer):
    """Exits at start-up for a reason that has nothing to do with ports."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit('no model weights in /models/nowhere')"]


@pytest.fixture
def root(tmp_path):
    (tmp_path / "health").write_text("ok")
    return tmp_path


@pytest.fixture
def taken():
    """A port another process holds: a real listening socket."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def test_a_server_whose_port_was_taken_starts_again_on_another(root, taken, caplog):
    with caplog.at_level(logging.WARNING, "miles_async.inference.launcher"), HttpServer(root, [taken]) as server:
        assert server.starts == 2 and server.port != taken
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert requests.get(server.url + "/health", timeout=5).text == "ok"
        log = server.log_path.read_text()
    # The first start's own words, then the launcher's, in the engine's log and in this process's.
    assert log.index("Address already in use") < log.index(f"starting it again on port {server.port}")
    assert f"a port was taken (port {taken}, or one the server derives from it" in log
    assert f"starting it again on port {server.port} (start 2 of {PORT_ATTEMPTS})" in caplog.text


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_controller_records_the_server_started_again(root, taken, monkeypatch):
    """Every engine process the run started is recorded (processes.json's "engines_started", which the end-to-end
    tests check none outlives the run): the server started again after a port clash too. The engine is
    ``HttpServer`` registered as a --rollout-backend: SGLang and vLLM clash the same way, but start in 30-60 s."""

    class Clashing(HttpServer):
        def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None):
            super().__init__(root, [taken])

    monkeypatch.setitem(
        ENGINES, "http", EngineSpec(EngineKind("http", weight_routes=()), EmbeddedEngineClient, Clashing)
    )
    controller = InferenceController(dataclasses.replace(_cfg(str(root)), backend="http"), str(root / "logs"))

    async def go() -> None:
        try:
            await controller.start()
        finally:
            await controller.dispose()

    asyncio.run(go())
    engine = controller.engines[0]
    assert len(engine.pids) == 2 and engine.pids[-1] == engine.pid  # the clash's start, then the one that serves
    assert controller.all_engine_pids() == engine.pids
    assert all(_exited(pid) for pid in engine.pids)


def test_a_port_taken_at_every_start_fails_saying_so(root, taken):
    server = HttpServer(root, [taken] * PORT_ATTEMPTS)
    with pytest.raises(EngineStartError, match=f"a port was taken at each of its {PORT_ATTEMPTS} starts"):
        with server:
            pass
    assert server.starts == PORT_ATTEMPTS


def test_a_failure_that_is_not_a_port_clash_is_not_started_again(root):
    server = BrokenServer(root, [])
    with pytest.raises(
        EngineStartError, match="(?s)exited with code 1 before becoming healthy; see .*no model weights"
    ):
        with server:
            pass
    assert server.starts == 1
    assert "starting it again" not in server.log_path.read_text()


def test_the_embedded_engine_holds_its_port_from_construction(tiny_model, tmp_path):
    engine = EmbeddedEngineProcess(_cfg(str(tiny_model)), 0, str(tmp_path))
    with socket.socket() as other:  # no other process can take the port before the server starts
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", engine.port))
        assert refused.value.errno == errno.EADDRINUSE
    with engine:
        assert requests.get(engine.url + "/health", timeout=5).status_code == 200
        assert f"on http://127.0.0.1:{engine.port}" in engine.log_path.read_text()
