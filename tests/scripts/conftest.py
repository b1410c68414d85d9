"""Fixtures of the script tests."""

from __future__ import annotations

import pytest

from tests.scripts.helpers import Job


@pytest.fixture
def job_factory():
    """Makes runs of the Slurm script (``Job(nodes, **env)``); each is stopped and removed afterwards."""
    jobs: list[Job] = []

    def make(nodes: list[str], **env: str) -> Job:
        jobs.append(Job(nodes, **env))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()
