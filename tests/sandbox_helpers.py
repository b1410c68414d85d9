"""For the tests that run tools in the namespace sandbox: tight limits, and the skip where the kernel refuses
namespaces (each such test is named in tests/allowed_skips.toml).

Whether the kernel allows them is asked by a bare child of our own here, never through ``rollout.sandbox``: a bug
in our set-up (a wrong struct for ``mount_setattr``, a mount in the wrong order) must fail these tests, not look
like a kernel that refuses namespaces and skip them."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from miles_async.config import SandboxConfig

# Nothing a hostile tool does under these can load the shared machine.
TIGHT = SandboxConfig("namespace", cpu_seconds=2, memory_mb=256, file_size_mb=1, open_files=64, max_processes=16)

NAMESPACES = "user, mount, PID, IPC and network"
# unshare(2) of every namespace the sandbox can ask for (<linux/sched.h>: CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID
# | CLONE_NEWIPC | CLONE_NEWNET), in an interpreter that imports nothing but ctypes (-I -S: one thread, as
# unshare(CLONE_NEWUSER) requires). Exit 3 with the kernel's errno where it refuses.
_UNSHARE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x00020000 | 0x20000000 | 0x08000000 | 0x40000000) != 0:
    err = ctypes.get_errno()
    print(f"{os.strerror(err)} (errno {err})")
    sys.exit(3)
"""
REFUSED = 3


@functools.cache
def _refusal() -> str | None:
    """The kernel's answer when a bare child asks it for the namespaces; None where it allows them."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _UNSHARE], capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode == REFUSED:
        return done.stdout.strip()
    if done.returncode != 0:  # not the kernel's answer: the probe itself broke, which must not pass for a skip
        raise RuntimeError(f"the namespace probe exited with code {done.returncode}: {done.stderr[-2000:]}")
    return None


def require_namespaces() -> None:
    """Skips the test where this kernel refuses a bare process the namespaces the sandbox needs. Where it allows
    them, whatever fails after (our own set-up included) fails the test."""
    refusal = _refusal()
    if refusal is not None:
        pytest.skip(f"the kernel refuses unshare({NAMESPACES} namespaces) in a bare child process: {refusal}")
