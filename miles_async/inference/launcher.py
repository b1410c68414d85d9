"""Start and stop engine server processes, bound to their parent's lifetime.

``EngineProcess`` is the launcher half of the engine protocol: each engine's launcher
(``<engine>/launcher.py``) says how to start its server (``command``, ``env``) and the base
starts it in its own process group that dies with its parent, waits until ``/health`` answers
(or the process exits, or the timeout passes) and stops it.

A server that listens beyond loopback requires the run's API key (``server_api_key``; ``inference/auth.py``):
it gets it in its environment (``$MILES_ASYNC_ENGINE_API_KEY``, and whatever variable the engine reads itself),
on its command line only where the engine reads it from nowhere else (SGLang); a server beyond loopback without
a key is refused before it starts. Its log gets the key masked (SGLang prints every server argument at
start-up, its key among them)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from miles_async.inference.auth import API_KEY_ENV, auth_headers, is_loopback, reveal

if TYPE_CHECKING:
    from miles_async.config import EngineConfig  # an annotation only: config reads the engines' declarations

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the kernel sends SIGTERM to the engine if the process that started
    # it (a Ray actor) dies, even by SIGKILL, so no engine outlives its controller.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)
    except OSError:
        pass
    os.setsid()


ROOT = Path(__file__).resolve().parents[2]  # the checkout: engines import stand-ins and extensions from it
CACHE = Path(os.environ.get("MILES_ASYNC_CACHE", Path.home() / ".cache" / "miles-async"))


def engine_python(engine: str, explicit: str | None) -> str:
    """The interpreter that runs ``engine`` ("sglang", "vllm"): --<engine>-python, $MILES_ASYNC_<ENGINE>_PYTHON,
    the engine's cached environment (scripts/setup_<engine>_env.sh), or (last) this one."""
    if explicit:
        return explicit
    if os.environ.get(f"MILES_ASYNC_{engine.upper()}_PYTHON"):
        return os.environ[f"MILES_ASYNC_{engine.upper()}_PYTHON"]
    cached = CACHE / f"venv-{engine}" / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable


class EngineProcess:
    """One engine server: a child process listening on ``cfg.host``; subclasses give its ``command``."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None, model_path: str | None = None):
        self.cfg = cfg
        self.index = index
        self.port = free_port(cfg.host)
        self.url = f"http://{cfg.host}:{self.port}"
        self.model_path = model_path or cfg.model_path
        self.log_path = Path(log_dir) / f"engine_{index}.log" if log_dir else None
        self.proc: subprocess.Popen | None = None
        # Which --rollout-num-gpus-per-engine wide slice of the visible GPUs is this engine's: its index when
        # engines share the GPUs of one process, 0 when every visible GPU is its own (a placement bundle).
        self.gpu_slot = index

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def server_api_key(self) -> str | None:
        """The key this server requires: the run's, when it listens where other machines can reach it."""
        if is_loopback(self.cfg.host):
            return None
        if self.cfg.api_key is None:
            raise EngineStartError(
                f"engine {self.index} would listen on {self.cfg.host}, reachable from other machines, without an "
                f"API key (EngineConfig.api_key; ${API_KEY_ENV} sets one)"
            )
        return reveal(self.cfg.api_key)

    def env(self) -> dict:
        """The server's environment: this one's, offline, with ``--rollout-num-threads`` CPU threads, and the key
        it requires in ``$MILES_ASYNC_ENGINE_API_KEY`` (unset when it requires none)."""
        env = dict(
            os.environ, OMP_NUM_THREADS=str(self.cfg.num_threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
        )
        env.pop(API_KEY_ENV, None)
        key = self.server_api_key()
        if key is not None:
            env[API_KEY_ENV] = key
        return env

    def auth_headers(self) -> dict[str, str]:
        """What a request to this server carries: the run's key (harmless to a server that requires none)."""
        return auth_headers(self.cfg.api_key)

    def start(self) -> None:
        env = self.env()
        secret = self.server_api_key()
        if not self.log_path:
            out = subprocess.DEVNULL
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_path.open("ab")
        masked = secret is not None and out is not subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE if masked else out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
        if masked:
            threading.Thread(
                target=_copy_masking, args=(self.proc.stdout, out, secret), name=f"engine-{self.index}-log", daemon=True
            ).start()

    def __enter__(self) -> EngineProcess:
        """Start and wait until healthy (``cfg.startup_timeout``); stopped on leaving the block."""
        self.start()
        try:
            self.wait_healthy(self.cfg.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health, failing at once if the process exits instead."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc else None
                raise EngineStartError(
                    f"engine {self.index} exited with code {code} before becoming healthy; "
                    f"see {self.log_path}:\n{self.tail_log()}"
                )
            try:
                if requests.get(self.url + "/health", headers=self.auth_headers(), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise EngineStartError(
            f"engine {self.index} at {self.url} not healthy after {timeout:.0f}s "
            f"(--engine-startup-timeout); see {self.log_path}"
        )

    def tail_log(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def _copy_masking(src, dst, secret: str) -> None:
    """Copy the server's output to its log line by line, the key replaced by ``***``, until the server exits."""
    needle = secret.encode()
    with src, dst:
        for line in iter(src.readline, b""):
            dst.write(line.replace(needle, b"***"))
            dst.flush()


class ServerEngineProcess(EngineProcess):
    """An external engine's server (SGLang, vLLM) run in its own environment; ``weight_version`` is the version it
    reports until the first update, and ``passthrough`` its --<engine>-* flags."""

    def __init__(
        self, cfg: EngineConfig, index: int, log_dir: str | None, model_path: str | None = None, weight_version: int = 0
    ):
        super().__init__(cfg, index, log_dir, model_path)
        self.weight_version = weight_version

    @staticmethod
    def given(passthrough: tuple[str, ...]) -> set[str]:
        """The flags the user passed through (``--flag`` and ``--flag=value`` alike): launcher defaults yield
        to them."""
        return {a.partition("=")[0] for a in passthrough if a.startswith("--")}
