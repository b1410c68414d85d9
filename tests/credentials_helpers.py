"""The credentials a run's driver may hold, set in the test's own process before it starts a child the way a run
does; and the check that the child's environment holds none of them, by name or by value."""

from __future__ import annotations

import pytest

# Names as users set them (utils/credentials.py decides what counts as one); values unique to these tests.
DRIVER_CREDENTIALS = {
    "WANDB_API_KEY": "wandb-key-0f3a9c",
    "HF_TOKEN": "hf-token-9c1d2e",
    "MILES_ASYNC_API_TOKEN": "control-token-5e7b81",
    "MILES_ASYNC_ENGINE_API_KEY": "engine-key-2b8c4f",
    "RAY_AUTH_TOKEN": "ray-token-77aa03",
    "AWS_ACCESS_KEY_ID": "AKIA0EXAMPLE4B1D",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-4d2e6b",
    "AWS_SESSION_TOKEN": "aws-session-6a1f90",
}


def hold_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process holds every credential of ``DRIVER_CREDENTIALS``, as a run's driver may."""
    for name, value in DRIVER_CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def proc_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with, as the kernel keeps it (empty once it has exited)."""
    with open(f"/proc/{pid}/environ", "rb") as fh:
        entries = fh.read().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def assert_no_credentials(env: dict[str, str], who: str) -> None:
    named = sorted(set(DRIVER_CREDENTIALS) & set(env))
    valued = sorted(k for k, v in env.items() if any(secret in v for secret in DRIVER_CREDENTIALS.values()))
    assert not named and not valued, f"{who}'s environment holds credentials: {named} by name, {valued} by value"
