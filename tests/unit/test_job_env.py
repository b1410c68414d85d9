"""What a run's workers get in their environment on a cluster it joins: its MILES_ASYNC_* settings, no secret
(miles_async/ray/cluster.py). That the settings arrive is shown by every e2e run on the tests' shared cluster
whose doubles read one (tests/e2e/rewards.py, trainer_doubles.py)."""

from miles_async.ray.cluster import job_env


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
