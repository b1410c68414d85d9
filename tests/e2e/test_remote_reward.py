"""train_async.py end to end with rewards from outside: a real reward server (--rm-url) one-step-off, and a
--group-rm hook under --fully-async."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from tests.e2e.runner import all_pids, run_train, tiny_args, wait_all_dead, without_rm_type
from tests.reward_server import RewardServer

# Values no built-in reward gives: every reward the run trained on must have come from the server.
RIGHT, WRONG = 0.75, 0.25


def test_rm_url_scores_every_sample_on_the_server(tiny_model, tiny_task, tmp_path):
    with RewardServer(RIGHT, WRONG) as server:
        run = run_train(
            without_rm_type(
                tiny_args(
                    tiny_model,
                    tiny_task,
                    tmp_path,
                    "--num-rollout",
                    "3",
                    "--rm-url",
                    server.url,
                    "--rm-batch-size",
                    "4",
                )
            ),
            tmp_path,
        )
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.metrics) == 3
    rewards = [r for rollout in run.rollouts for group in rollout["rewards"] for r in group]
    assert len(rewards) == 3 * 8 * 4
    assert set(rewards) <= {RIGHT, WRONG}
    for rollout, m in zip(run.rollouts, run.metrics):
        mine = [r for group in rollout["rewards"] for r in group]
        assert m["rollout/reward_mean"] == pytest.approx(statistics.fmean(mine))
    # Every trained sample went through the server, in requests of at most --rm-batch-size samples.
    assert sum(server.batch_sizes) >= len(rewards)
    assert max(server.batch_sizes) == 4
    assert all(isinstance(body, list) for body in server.bodies)


def test_an_unreachable_reward_server_fails_the_run_naming_the_url(tiny_model, tiny_task, tmp_path, refused_port):
    url = f"http://127.0.0.1:{refused_port}/reward"  # held by the test, never listening: connections refused
    args = [*tiny_args(tiny_model, tiny_task, tmp_path, "--num-rollout", "3"), "--rm-max-retries", "1"]
    args += ["--rm-url", url, "--rm-retry-backoff", "0.1"]
    run = run_train(without_rm_type(args), tmp_path)
    assert run.returncode != 0
    assert f"reward server --rm-url {url}: gave up after 2 attempts" in run.output, run.output[-4000:]
    assert run.metrics == []
    assert wait_all_dead(all_pids(run.processes())) == []


def index_rank(group: list) -> list[float]:
    """A --group-rm hook: rewards by position in the group, so only a hook that saw the whole group in order
    can give them; appends each group's (uid, indices) to the marker file."""
    with Path(os.environ["MILES_ASYNC_TEST_MARKER"]).open("a") as fh:
        fh.write(json.dumps([group[0].uid, [s.index for s in group]]) + "\n")
    return [s.index / (len(group) - 1) for s in group]


def test_group_rm_hook_scores_whole_groups_under_fully_async(tiny_model, tiny_task, tmp_path):
    marker = tmp_path / "groups.jsonl"
    run = run_train(
        without_rm_type(
            tiny_args(
                tiny_model,
                tiny_task,
                tmp_path,
                "--num-rollout",
                "3",
                "--fully-async",
                "--custom-rm-path",
                "tests.e2e.test_remote_reward:index_rank",
                "--group-rm",
            )
        ),
        tmp_path,
        extra_env={"MILES_ASYNC_TEST_MARKER": str(marker)},
    )
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.metrics) == 3
    seen = [json.loads(line) for line in marker.read_text().splitlines()]
    assert seen and all(indices == [0, 1, 2, 3] for _, indices in seen)
    for rollout in run.rollouts:
        assert len(rollout["rewards"]) == 8
        assert all(group == [0.0, 1 / 3, 2 / 3, 1.0] for group in rollout["rewards"])
        assert set(rollout["uids"]) <= {uid for uid, _ in seen}
