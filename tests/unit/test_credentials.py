"""utils/credentials.py: what counts as a credential, the 0600 file, and the environment a cluster the run starts
copies (``ray/cluster.py``: its processes get the run's credentials only where Ray needs its own)."""

from __future__ import annotations

import os

from miles_async.ray.cluster import job_env
from miles_async.utils.credentials import private_file, secrets_withheld, without_secrets


def test_credentials_are_named_so_and_kept_from_children_but_rays_own(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "w-1")
    monkeypatch.setenv("MILES_ASYNC_API_TOKEN", "t-1")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "r-1")
    monkeypatch.setenv("MILES_ASYNC_LOG_LEVEL", "DEBUG")
    with secrets_withheld():
        inside = dict(os.environ)
    assert "WANDB_API_KEY" not in inside and "MILES_ASYNC_API_TOKEN" not in inside
    assert inside["RAY_AUTH_TOKEN"] == "r-1" and inside["MILES_ASYNC_LOG_LEVEL"] == "DEBUG"
    assert os.environ["WANDB_API_KEY"] == "w-1" and os.environ["MILES_ASYNC_API_TOKEN"] == "t-1"  # given back
    assert without_secrets({"HF_TOKEN": "h", "DB_PASSWORD": "p", "PATH": "/bin"}) == {"PATH": "/bin"}
    assert job_env(dict(os.environ))["MILES_ASYNC_LOG_LEVEL"] == "DEBUG"
    assert "MILES_ASYNC_API_TOKEN" not in job_env(dict(os.environ))


def test_a_private_file_is_the_owners_alone_from_its_first_byte_and_replaces_a_wider_one(tmp_path):
    made = private_file("k-1")
    try:
        assert made.read_text() == "k-1" and (made.stat().st_mode & 0o777) == 0o600
    finally:
        made.unlink()
    target = tmp_path / "api_token"
    target.write_text("old")
    target.chmod(0o644)
    assert private_file("k-2", target) == target
    assert target.read_text() == "k-2" and (target.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["api_token"]  # no temporary left beside it
