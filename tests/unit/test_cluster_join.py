"""Joining a Ray cluster (--ray-address, miles_async/ray/cluster.py): the run's workers get its MILES_ASYNC_*
settings and no secret (that the settings arrive is shown by every e2e run on the tests' shared cluster whose
doubles read one: tests/e2e/rewards.py, trainer_doubles.py), and an address where nothing listens fails the run
naming the flag instead of hanging in Ray's retries."""

import time

import pytest

from miles_async.ray.cluster import job_env, wait_reachable


def test_the_runs_settings_reach_its_workers_and_its_secrets_do_not():
    env = job_env(
        {
            "MILES_ASYNC_ACTOR_CLASS": "pkg:Cls",
            "MILES_ASYNC_TEST_MARKER": "/tmp/m",
            "MILES_ASYNC_API_TOKEN": "t0ken",
            "MILES_ASYNC_ENGINE_API_KEY": "k3y",
            "WANDB_API_KEY": "w",
            "PATH": "/bin",
        }
    )
    assert env == {
        "MILES_ASYNC_ACTOR_CLASS": "pkg:Cls",
        "MILES_ASYNC_TEST_MARKER": "/tmp/m",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }


def test_a_ray_address_where_nothing_listens_fails_naming_the_flag(refused_port):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"--ray-address 127.0.0.1:{refused_port}: nothing accepted"):
        wait_reachable(f"127.0.0.1:{refused_port}", timeout=1.5)
    assert time.monotonic() - started < 10
