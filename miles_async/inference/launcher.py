"""Start and stop engine server processes, bound to their parent's lifetime.

``EngineProcess`` is the launcher half of the engine protocol: each engine's launcher
(``<engine>/launcher.py``) says how to start its server (``command``, ``env``) and the base
starts it in its own process group that dies with its parent, waits until ``/health`` answers
(or the process exits, or the timeout passes) and stops it.

Every server requires the run's API key (``server_api_key``; ``inference/auth.py``), on loopback too: at each
start the launcher writes it to a file only this user may read (``key_path``, removed when the server stops) and
the server finds that file in ``$MILES_ASYNC_ENGINE_API_KEY_FILE``; the key itself is on no command line and in
no environment. A server without a key is refused before it starts. The server's environment is this process's
without its credentials (``utils/credentials.py``). Its log gets the key masked (SGLang prints every server
argument at start-up, its key among them).

A server takes the port ``pick_port`` gives it (``utils/ports.py``): by default a number free now, which another
process may take before the server binds it, or one of the ports SGLang derives from it may be taken. So a server
that exits before it is healthy, saying a port was taken, is started again on a fresh port (``start_again``: at
most ``PORT_ATTEMPTS`` starts), and the engine's log and this process's say so; ``url`` then names the new port.
The embedded engine needs none of this: it listens on a socket bound here (``embedded/launcher.py``)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import requests

from miles_async.config.engine import EngineConfig
from miles_async.inference.auth import KEY_FILE_ENV, auth_headers, reveal
from miles_async.utils.api_key import API_KEY_ENV
from miles_async.utils.cpus import check_available
from miles_async.utils.credentials import private_file, without_secrets
from miles_async.utils.ports import PORT_ATTEMPTS, free_port, port_clash, start_again

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


def _die_with_parent(cores: tuple[int, ...] | None = None) -> None:
    # PR_SET_PDEATHSIG: the kernel sends SIGTERM to the engine if the process that started
    # it (a Ray actor) dies, even by SIGKILL, so no engine outlives its controller.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)
    except OSError:
        pass
    os.setsid()
    if cores:  # before the server starts: every thread and process it makes inherits them
        os.sched_setaffinity(0, cores)


ROOT = Path(__file__).resolve().parents[2]  # the checkout: engines import stand-ins and extensions from it


class EngineProcess:
    """One engine server: a child process listening on ``cfg.host``; subclasses give its ``command``."""

    def __init__(self, cfg: EngineConfig, index: int, log_dir: str | None, model_path: str | None = None):
        self.cfg = cfg
        self.index = index
        self.use_port(self.pick_port())
        self.model_path = model_path or cfg.model_path
        self.log_path = Path(log_dir) / f"engine_{index}.log" if log_dir else None
        self.proc: subprocess.Popen | None = None
        # Every server process this launcher started, one per start: a start again after a port clash adds one.
        self.pids: list[int] = []
        self._log_start = 0  # where this start's output begins in the log
        self._copier: threading.Thread | None = None  # copies a masked server's output to its log
        self.key_path: Path | None = None  # the 0600 file holding the key, while a server runs
        # Which --rollout-num-gpus-per-engine wide slice of the visible GPUs is this engine's: its index when
        # engines share the GPUs of one process, 0 when every visible GPU is its own (a placement bundle).
        self.gpu_slot = index

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def pick_port(self) -> int:
        """A port for the server's next start."""
        return free_port(self.cfg.host)

    def use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://{self.cfg.host}:{port}"

    def pass_fds(self) -> tuple[int, ...]:
        """File descriptors the server inherits (a socket to listen on)."""
        return ()

    def server_api_key(self) -> str:
        """The key this server requires: the run's, wherever it listens."""
        if self.cfg.api_key is None:
            raise EngineStartError(
                f"engine {self.index} would answer anyone on {self.cfg.host} without an API key "
                f"(EngineConfig.api_key; ${API_KEY_ENV} sets one)"
            )
        return reveal(self.cfg.api_key)

    def env(self) -> dict:
        """The server's environment: this one's without its credentials, offline, with ``--rollout-num-threads``
        CPU threads, and the path of the key file in ``$MILES_ASYNC_ENGINE_API_KEY_FILE`` once it is written."""
        env = without_secrets(os.environ)
        env.update(OMP_NUM_THREADS=str(self.cfg.num_threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop(KEY_FILE_ENV, None)
        if self.key_path is not None:
            env[KEY_FILE_ENV] = str(self.key_path)
        return env

    def auth_headers(self) -> dict[str, str]:
        """What a request to this server carries: the run's key (harmless to a server that requires none)."""
        return auth_headers(self.cfg.api_key)

    def start(self) -> None:
        secret = self.server_api_key()
        self._remove_key_file()
        self.key_path = private_file(secret, prefix=f"miles-async-engine-{self.index}-key-")
        env = self.env()
        if not self.log_path:
            out = subprocess.DEVNULL
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_path.open("ab")
            self._log_start = out.tell()
        masked = out is not subprocess.DEVNULL
        cores = self.cfg.cpu_affinity
        if cores:
            try:
                check_available(cores, "--rollout-cpu-affinity")
            except ValueError as e:
                raise EngineStartError(str(e)) from None
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE if masked else out,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=self.pass_fds(),
            preexec_fn=functools.partial(_die_with_parent, cores),
        )
        self.pids.append(self.proc.pid)
        if masked:
            self._copier = threading.Thread(
                target=_copy_masking, args=(self.proc.stdout, out, secret), name=f"engine-{self.index}-log", daemon=True
            )
            self._copier.start()

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
        """Poll /health, failing at once if the process exits instead, unless it exited because a port was taken:
        then start it again on a fresh port (each start gets ``timeout`` seconds)."""
        attempt = 1
        while not self._wait_healthy_once(timeout):
            self._kill_group()  # what the server started may still hold ports, and its output
            if self._copier is not None:
                self._copier.join(5)
            output = self.start_output()
            if not start_again(attempt, output):
                code = self.proc.returncode if self.proc else None
                clashes = f" (a port was taken at each of its {attempt} starts)" if port_clash(output) else ""
                raise EngineStartError(
                    f"engine {self.index} exited with code {code} before becoming healthy{clashes}; "
                    f"see {self.log_path}:\n{self.tail_log()}"
                )
            taken = self.port
            self.use_port(self.pick_port())
            attempt += 1
            self._note(
                f"engine {self.index}: a port was taken (port {taken}, or one the server derives from it: its output "
                f"says the address is in use); starting it again on port {self.port} (start {attempt} of "
                f"{PORT_ATTEMPTS})"
            )
            self.start()

    def _wait_healthy_once(self, timeout: float) -> bool:
        """True once /health answers 200; False if the process exits first."""
        try:
            return self.proc is not None and await_health(self.proc, self.url, timeout, self.auth_headers())
        except TimeoutError:
            self.stop()
            raise EngineStartError(
                f"engine {self.index} at {self.url} not healthy after {timeout:.0f}s "
                f"(--engine-startup-timeout); see {self.log_path}"
            ) from None

    def tail_log(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def start_output(self) -> str:
        """What the server printed since its last start ("" without a log)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as fh:
            fh.seek(self._log_start)
            return fh.read().decode(errors="replace")

    def _note(self, message: str) -> None:
        """A line in this process's log and in the engine's."""
        logger.warning("%s", message)
        if self.log_path:
            with self.log_path.open("a") as fh:
                fh.write(f"[miles-async launcher] {message}\n")

    def _kill_group(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _remove_key_file(self) -> None:
        if self.key_path is not None:
            self.key_path.unlink(missing_ok=True)
            self.key_path = None

    def stop(self, grace: float = 5.0) -> None:
        self._remove_key_file()
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


def await_health(proc: subprocess.Popen, url: str, timeout: float, headers: dict[str, str] | None = None) -> bool:
    """Poll ``url``/health: True once it answers 200, False as soon as ``proc`` exits instead; ``TimeoutError``
    after ``timeout`` seconds of neither."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if requests.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f}s")


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
