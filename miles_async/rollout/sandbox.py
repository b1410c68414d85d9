"""Sandboxed worker processes: what tool workers and verifier workers start in, and how they end.

``Sandboxed(argv, cfg)`` starts ``argv`` through ``rollout.sandbox_exec`` under ``cfg.mode`` (``--tool-sandbox``):
in a fresh folder of its own (its working directory, ``HOME`` and ``TMPDIR``), in its own session, with a
parent-death signal, no descriptors but its stdin/stdout pipes and stderr, and an allowlisted environment, never
a copy of ours: our process holds the control API's token, the engine's key, ``WANDB_API_KEY`` and Ray's
variables, and a tool runs what a model asked for. ``kill()`` ends it with everything it started and removes the
folder. docs/tool-sandbox.md says what each mode contains and what was verified.
"""

from __future__ import annotations

import copy
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the configs import much; tool workers import this module's importers
    from miles_async.config.tools import SandboxConfig

EXEC = str(Path(__file__).with_name("sandbox_exec.py"))
SETUP_TIMEOUT_S = 30.0  # from start to the worker command running: a few milliseconds unless the machine stalls
# Passed on as they are: none of them can hold a secret.
ALLOWED_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC", "TZ", "TERM")
# One thread per numeric library: a worker's threads count against --tool-max-processes.
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MB = 1 << 20


class SandboxError(RuntimeError):
    """A sandboxed process could not be set up; the message says which step failed."""


def import_path() -> str:
    """Our import path for a worker that imports the same modules by name (``''`` is our working directory)."""
    return os.pathsep.join(dict.fromkeys(os.path.abspath(p) if p else os.getcwd() for p in sys.path))


def needed_paths() -> list[str]:
    """What a worker reads to start: our interpreter's environment and every folder on our import path. A private
    /tmp would hide those that live under it (a checkout or a cache in /tmp), so ``sandbox_exec`` binds them back,
    read-only. Outermost folders only: binding one binds what is under it."""
    paths = {
        os.path.realpath(p) for p in (sys.prefix, os.path.dirname(sys.executable), *import_path().split(os.pathsep))
    }
    paths = sorted(p for p in paths if os.path.isdir(p))
    return [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]


def worker_env(folder: str) -> dict[str, str]:
    """A worker's whole environment: the allowlisted variables of ours, and its own folder as home."""
    env = {name: os.environ[name] for name in ALLOWED_ENV if name in os.environ}
    env.update(dict.fromkeys(ONE_THREAD, "1"))
    env.update(HOME=folder, TMPDIR=folder, PYTHONPATH=import_path(), PYTHONDONTWRITEBYTECODE="1")
    return env


def coverage_env(folder: str) -> dict[str, str]:
    """Under ``scripts/coverage.sh`` only, where coverage.py measures this process: what lets a sandboxed process
    measure itself too. It gets the running configuration and writes its data in its own folder, the one place it
    may write; ``kill()`` moves that data out. Empty in any other run, and then no worker starts differently."""
    cov = sys.modules["coverage"].Coverage.current() if "coverage" in sys.modules else None
    if cov is None:
        return {}
    config = copy.copy(cov.config)
    config.data_file = os.path.join(folder, ".coverage")
    return {"COVERAGE_PROCESS_CONFIG": config.serialize()}


def _move_coverage_data(folder: str) -> None:
    """A measured worker's data files, moved to where this process's own go (see ``coverage_env``)."""
    cov = sys.modules["coverage"].Coverage.current()
    target = os.path.dirname(os.path.abspath(cov.config.data_file))
    for name in os.listdir(folder):
        if name.startswith(".coverage."):
            shutil.move(os.path.join(folder, name), os.path.join(target, f"{name}.sandboxed"))


def limits(cfg: SandboxConfig) -> dict[str, int]:
    """The resource limits ``sandbox_exec`` sets (none for ``--tool-sandbox none``)."""
    if cfg.mode == "none":
        return {}
    out = {
        "cpu": max(1, round(cfg.cpu_seconds)),
        "as": cfg.memory_mb * MB,
        "fsize": cfg.file_size_mb * MB,
        "nofile": cfg.open_files,
        "core": 0,
    }
    if cfg.mode == "namespace":  # elsewhere RLIMIT_NPROC counts all of the user's processes, or none for root
        out["nproc"] = cfg.max_processes
    return out


def exit_signal(returncode: int | None) -> int | None:
    """The signal that ended a worker: negative return codes, or 128 + signal through the namespace's init."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    return returncode - 128 if 128 < returncode < 128 + signal.NSIG else None


class Sandboxed:
    """One sandboxed process; ``proc.stdin`` and ``proc.stdout`` are pipes to it, its stderr is ours."""

    def __init__(self, argv: list[str], cfg: SandboxConfig, probe: bool = False, stdio: Any = subprocess.PIPE):
        """``stdio``: its stdin and stdout (pipes by default, or one end of a socket pair)."""
        self.folder = tempfile.mkdtemp(prefix="miles-async-worker-")
        self.init_pid: int | None = None  # namespace mode: killing it ends the namespace
        self._init_fd: int | None = None  # a pidfd of init: a signal through it never reaches a reused pid
        report_r, report_w = os.pipe()
        spec = {
            "mode": cfg.mode,
            "argv": argv,
            "folder": self.folder,
            "parent": os.getpid(),
            "report": report_w,
            "limits": limits(cfg),
            "no_network": cfg.no_network,
            "private_tmp": cfg.private_tmp,
            "needed": needed_paths() if cfg.private_tmp else [],
            "tmp_bytes": cfg.file_size_mb * MB,
            "probe": probe,
        }
        self._coverage = coverage_env(self.folder)
        # -I -S: nothing a tool could shadow is imported; under coverage, site starts coverage.py's hook.
        isolated = [] if self._coverage else ["-I", "-S"]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *isolated, EXEC, json.dumps(spec)],
                stdin=stdio,
                stdout=stdio,
                env={**worker_env(self.folder), **self._coverage},
                cwd=self.folder,
                pass_fds=(report_w,),
                start_new_session=True,  # its own session: a signal to our group does not reach it
            )
        except BaseException:
            os.close(report_r)
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        finally:
            os.close(report_w)
        try:
            error = self._read_report(report_r)
        finally:
            os.close(report_r)
        if self.init_pid is not None:
            try:
                self._init_fd = os.pidfd_open(self.init_pid)
            except ProcessLookupError:  # gone already: the launcher reaps it and exits
                pass
        if error is not None:
            self.kill()
            raise SandboxError(f"--tool-sandbox {cfg.mode}: {error}")

    def _read_report(self, fd: int) -> str | None:
        """Waits for the launcher's report to end (the command runs); the setup error, if any."""
        data, deadline = b"", time.monotonic() + SETUP_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return f"setting up the sandbox took longer than {SETUP_TIMEOUT_S:g} s"
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        error = None
        for line in data.decode(errors="replace").splitlines():
            message = json.loads(line)
            self.init_pid = message.get("init", self.init_pid)
            error = error or message.get("error")  # the first: what failed, not what failed after it
        return error

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> int | None:
        """Kills it and everything it started, removes its folder; its return code (None if it would not die)."""
        if self._coverage:  # a worker killed saves no data: at the end of its input it may end by itself
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if self._init_fd is not None:
            try:
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)  # the kernel empties the namespace first
            except ProcessLookupError:
                pass
            os.close(self._init_fd)
            self._init_fd = None
            try:
                self.proc.wait(timeout=10)  # the launcher exits once init is reaped
            except subprocess.TimeoutExpired:
                pass
        if self.proc.returncode is None:  # not reaped: its pid, and so its group's id, is still ours
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
            if self._coverage:
                _move_coverage_data(self.folder)
            _remove(self.folder)


def _remove(folder: str) -> None:
    """Removes a worker's folder, including what a tool made unreadable to its owner."""

    def unlock_and_retry(function, path, _exc):  # noqa: ANN001 - shutil's onerror signature
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            function(path)
        except OSError:
            pass

    shutil.rmtree(folder, onerror=unlock_and_retry)


def describe(cfg: SandboxConfig) -> str:
    """The mechanism and limits in words, for the log at start."""
    if cfg.mode == "none":
        return "none: no limits; a fresh worker per sample with an allowlisted environment"
    limited = (
        f"{cfg.cpu_seconds:g} CPU s, {cfg.memory_mb} MiB address space, {cfg.file_size_mb} MiB files, "
        f"{cfg.open_files} open files"
    )
    if cfg.mode == "rlimits-only":
        return f"rlimits-only: {limited}; no process limit, no namespaces"
    extra = ", no network" if cfg.no_network else ""
    extra += ", private /tmp" if cfg.private_tmp else ""
    return (
        f"namespace: user, PID, mount and IPC namespaces{extra}; read-only but the worker's folder; "
        f"{limited}, {cfg.max_processes} processes"
    )


def probe(cfg: SandboxConfig) -> None:
    """Sets up a sandbox as a worker would get it and exits; ``SandboxError`` naming the flag and the failing step
    if this machine does not allow ``cfg.mode``."""
    if cfg.mode == "none":
        return
    weaker = "rlimits-only or none" if cfg.mode == "namespace" else "none"
    hint = f"(give --tool-sandbox {weaker} to run tools without it)"
    try:
        box = Sandboxed([sys.executable], cfg, probe=True)
    except SandboxError as e:
        detail = str(e).removeprefix(f"--tool-sandbox {cfg.mode}: ")
        raise SandboxError(f"--tool-sandbox {cfg.mode}: this machine does not allow it: {detail} {hint}") from None
    try:
        code = box.proc.wait(timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    box.kill()
    if code != 0:
        raise SandboxError(f"--tool-sandbox {cfg.mode}: setting up a sandbox ended with exit code {code} {hint}")
