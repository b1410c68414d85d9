"""Shared helpers for the script tests: where things are, finding the lint tools, finding (and
ending) every process a test started, by a marker in its environment, and a run of the Slurm script (started
again on fresh ports when Ray could not bind one: ``Job``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from miles_async.utils.ports import PORT_ATTEMPTS, free_port, start_again

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "stubs"
GOLDEN = Path(__file__).resolve().parent / "golden"
SBATCH = ROOT / "scripts" / "slurm" / "train-async.sbatch"
# The interpreter's own bin folder (a venv's), not resolved: the venv's ray, shellcheck, hadolint.
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A lint tool pinned in requirements-test.txt: the venv's copy first, then PATH."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, f"{name} not found: pip install -r requirements-test.txt (it pins {name})"
    return found


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds MILES_TEST_MARKER=<marker>."""
    needle = f"MILES_TEST_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_marked_gone(marker: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = marked_pids(marker)
        if not left:
            return []
        time.sleep(0.5)
    return marked_pids(marker)


def kill_marked(marker: str) -> None:
    """SIGKILL, by pid, every process this test's marker is in (Ray nodes, drivers, workers)."""
    for _ in range(3):
        pids = marked_pids(marker)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def short_tmp(prefix: str) -> Path:
    """A short folder under /tmp: Ray's unix socket paths must stay under ~107 characters."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Job:
    """One run of the sbatch script, as Slurm would start it, with everything it spawns marked.

    ``ray start`` takes its ports (``port``: the GCS's; the client server's) on its command line, and another
    process on the machine may take one first: a job that fails during Ray's start-up saying a port was taken is
    started again on fresh ports (``start_again``), and its log says so."""

    def __init__(self, nodes: list[str], **env: str):
        self.tmp = short_tmp("mst")
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.save_dir = self.tmp / "ckpt"
        self.work = self.tmp / "work"
        self.work.mkdir()
        self.log_path = self.tmp / "job.log"
        self.env = {
            **os.environ,
            "PATH": f"{STUBS}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "MILES_TEST_MARKER": self.marker,
            "MILES_ASYNC_ROOT": str(ROOT),
            "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "test-job",
            "GPUS_PER_NODE": "2",
            "RAY_NUM_CPUS": "1",
            "RAY_PORT": str(self.port),
            "RAY_CLIENT_SERVER_PORT": str(free_port()),
            "RAY_INCLUDE_DASHBOARD": "false",
            "RAY_TEMP_DIR": str(self.tmp / "ray"),
            "RAY_START_EXTRA_ARGS": "--object-store-memory=100000000",
            "RAY_START_TIMEOUT": "90",
            # Past Ray's own drain on SIGTERM (up to 30 s): a `ray start --block` killed mid-drain leaves its raylet
            # and GCS behind here, where no Slurm step daemon reaps a step's processes.
            "RAY_STOP_GRACE": "40",
            "SAVE_DIR": str(self.save_dir),
            "SAVE_TIMEOUT": "60",
            "PYTHON": sys.executable,
            "STUB_SRUN_LOG": str(self.tmp / "srun.log"),
            "STUB_SCONTROL_LOG": str(self.tmp / "scontrol.log"),
            "FAKE_TRAIN_DIR": str(self.work),
            "RAY_DEDUP_LOGS": "0",
            **env,
        }
        self.proc: subprocess.Popen | None = None
        self._cmd: tuple[str, ...] = ()
        self._attempt = 0
        self._log_start = 0  # where this attempt's output begins in the log

    def start(self, *cmd: str) -> Job:
        self._cmd = cmd
        self._attempt = 1
        self._launch()
        return self

    def _launch(self) -> None:
        # Appended to, as Slurm's --open-mode=append does for a requeued job started again.
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            # Its own session, like a batch script; the marker finds what it leaves behind.
            self.proc = subprocess.Popen(
                ["bash", str(SBATCH), *self._cmd],
                cwd=self.tmp,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _started_again(self) -> bool:
        """For a job that has exited: start it again on fresh ports if it failed in Ray's start-up because a port
        was taken (and starts are left); whether it did."""
        output = self.log_path.read_bytes()[self._log_start :].decode(errors="replace")
        if self.proc.returncode == 0 or "Ray cluster ready" in output or not start_again(self._attempt, output):
            return False
        kill_marked(self.marker)  # what the failed attempt left, holding ports
        taken = (self.port, self.env["RAY_CLIENT_SERVER_PORT"])
        self.port = free_port()
        self.env.update(RAY_PORT=str(self.port), RAY_CLIENT_SERVER_PORT=str(free_port()))
        self._attempt += 1
        with open(self.log_path, "a") as log:
            log.write(
                f"[tests] Ray could not bind a port (GCS {taken[0]}, client server {taken[1]}, or one of its own): "
                f"starting the job again on {self.port} and {self.env['RAY_CLIENT_SERVER_PORT']} "
                f"(start {self._attempt} of {PORT_ATTEMPTS})\n"
            )
        self._launch()
        return True

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def srun_steps(self) -> list[tuple[str, str]]:
        path = self.tmp / "srun.log"
        return [tuple(line.split("\t", 1)) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if self.proc.poll() is not None and not cond() and not self._started_again():
                pytest.fail(f"job exited ({self.proc.returncode}) before {what}:\n{self.log}")
            time.sleep(0.3)
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{self.log}")

    def report(self) -> dict:
        path = self.work / "report.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        try:
            while True:
                rc = self.proc.wait(max(0.0, deadline - time.monotonic()))
                if not self._started_again():
                    return rc
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running after {timeout}s:\n{self.log}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        kill_marked(self.marker)
        shutil.rmtree(self.tmp, ignore_errors=True)
