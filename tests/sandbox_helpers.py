"""For the tests that run tools in the namespace sandbox: tight limits, and the skip where the machine refuses
namespaces (each such test is named in tests/allowed_skips.toml)."""

from __future__ import annotations

import functools

import pytest

from miles_async.config import SandboxConfig
from miles_async.rollout.sandbox import SandboxError, probe

# Nothing a hostile tool does under these can load the shared machine.
TIGHT = SandboxConfig("namespace", cpu_seconds=2, memory_mb=256, file_size_mb=1, open_files=64, max_processes=16)


@functools.cache
def _refusal() -> str | None:
    try:
        probe(TIGHT)
    except SandboxError as e:
        return str(e)
    return None


def require_namespaces() -> None:
    """Skips the test, naming the capability, where this machine does not allow the namespace sandbox."""
    refusal = _refusal()
    if refusal is not None:
        pytest.skip(
            f"needs user, PID and mount namespaces (unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS)): {refusal}"
        )
