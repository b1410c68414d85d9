"""One Ray cluster for the whole test session, which the tests' runs join instead of each starting its own.

A run that starts its own cluster pays Ray's start (GCS, raylet, agents: 4-12 s of CPU on 2 cores) and its
shutdown; joining a running one takes a tenth of a second. The cluster is started on first use, as
``ray start --head`` would start it for a user, with no GPUs, so the runs see what a local cluster of their own
shows them; but without token auth, because a process that imported Ray before (pytest's own, joining for a test
module) cannot turn it on (Ray reads $RAY_AUTH_MODE once). Joining a token-auth cluster, as users do, is what the
rehearsal cluster test does (scripts/slurm/train-async.sbatch starts its nodes with it). The root conftest stops
the cluster when the session ends.

Runs that test Ray's own start and shutdown (the signal and failure tests, whose Ray session must be gone after
them) or need logical GPUs keep a cluster of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 120
# The first driver would make Ray prestart a task worker per CPU, which no run uses (its actors get their own).
SYSTEM_CONFIG = json.dumps({"prestart_worker_first_driver": False})

_cluster: _Cluster | None = None


class _Cluster:
    def __init__(self, num_gpus: int = 0) -> None:
        # Ray's unix socket paths must stay under ~107 characters: a short folder of its own under /tmp.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="mrt", dir="/tmp"))
        self.env = {**os.environ, **join_env(), "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.run(
            [
                sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
                "--port=0",
                "--node-ip-address=127.0.0.1",
                f"--num-cpus={os.cpu_count()}",
                f"--num-gpus={num_gpus}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
                f"--system-config={SYSTEM_CONFIG}",
            ],
            env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        address_file = self.temp_dir / "ray_current_cluster"
        if proc.returncode != 0 or not address_file.exists():
            self.stop()
            raise RuntimeError(f"the tests' Ray cluster did not start (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        self.address = address_file.read_text().strip()

    def stop(self) -> None:
        """Ends this cluster's processes only (``ray stop`` would end every Ray cluster of the user's): those
        whose command line names its folder or address; the raylet's agents go with the raylet."""
        marks = [str(self.temp_dir), *([self.address] if getattr(self, "address", None) else [])]
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            pids = _pids_with(marks)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = _pids_with(marks)
            if not pids:
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _holds_a_file_under(pid: int, folder: str) -> bool:
    """The raylet's agents rename themselves (``ray::DashboardAgent``) but keep their logs open in its folder."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(folder) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _pids_with(marks: list[str]) -> list[int]:
    """This cluster's live processes: ``marks[0]`` its folder, then its address."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = _cmdline(int(entry))
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (any(m in cmd for m in marks) or _holds_a_file_under(int(entry), marks[0])):
            found.append(int(entry))
    return found


def address() -> str:
    """The session's cluster (started now if it is not yet running)."""
    global _cluster
    if _cluster is not None and not alive():
        # A test that killed it (a bug: it must end only what it started) must not fail every test after it.
        print(f"[tests] the shared Ray cluster at {_cluster.address} is gone; starting another", file=sys.stderr)
        _cluster.stop()
        _cluster = None
    if _cluster is None:
        started = time.monotonic()
        _cluster = _Cluster()
        print(
            f"[tests] shared Ray cluster at {_cluster.address} in {time.monotonic() - started:.1f} s", file=sys.stderr
        )
    return _cluster.address


@contextlib.contextmanager
def separate(num_gpus: int) -> Iterator[str]:
    """A cluster of its own for one test module, with logical GPUs (the shared one has none, as runs on a CPU see
    no GPUs); yields its address. An external cluster, as the shared one: a process that ran a cluster in itself
    (``ray.init(address="local")``) cannot join another one afterwards (Ray 2.60 cancels its actors)."""
    cluster = _Cluster(num_gpus=num_gpus)
    try:
        yield cluster.address
    finally:
        cluster.stop()


def alive() -> bool:
    """Whether the session's cluster still runs (its GCS and raylet)."""
    if _cluster is None:
        return False
    commands = [_cmdline(pid) for pid in _pids_with([str(_cluster.temp_dir)])]
    return any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands)


def join_env() -> dict[str, str]:
    """What a process joining the cluster has in its environment (no token auth: see above)."""
    return {"RAY_AUTH_MODE": "disabled"}


def stop() -> None:
    global _cluster
    if _cluster is not None:
        _cluster.stop()
        _cluster = None
