import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_async.config import DataConfig, RewardConfig
from miles_async.rollout.data_source import DataSource, load_prompts
from miles_async.rollout.rewards import RewardError, RewardModel
from miles_async.rollout.sample import Sample


def _cfg(path, shuffle=True):
    return DataConfig(str(path), "prompt", "label", None, False, None, shuffle, 7)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i), "uid": f"u{i}"}) + "\n" for i in range(10)))
    return path


def test_epochs_cover_every_prompt_once_and_resume_is_exact(data):
    ds = DataSource(_cfg(data), batch_size=3)
    first_epoch = [it.uid for _ in range(3) for it in ds.next_batch()]
    assert len(set(first_epoch)) == 9  # the tail shorter than a batch is dropped
    state = ds.state_dict()
    following = [[it.uid for it in ds.next_batch()] for _ in range(4)]
    resumed = DataSource(_cfg(data), batch_size=3)
    resumed.load_state_dict(state)
    assert [[it.uid for it in resumed.next_batch()] for _ in range(4)] == following
    assert ds.epoch == 2  # 3 batches per epoch: 3 + 4 batches reach the third epoch


def test_shuffle_changes_order_between_epochs(data):
    ds = DataSource(_cfg(data), batch_size=5)
    e0 = [it.uid for _ in range(2) for it in ds.next_batch()]
    e1 = [it.uid for _ in range(2) for it in ds.next_batch()]
    assert sorted(e0) == sorted(e1) and e0 != e1


def test_parquet_matches_jsonl(tmp_path, data):
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_prompts(str(tmp_path / "d.parquet"), "prompt", "label") == load_prompts(str(data), "prompt", "label")


def _sample(response, label):
    return Sample(uid="u", group_index=0, index=0, prompt="p", label=label, response=response)


@pytest.mark.parametrize(
    "rm_type, response, label, expected",
    [
        ("integer", "The answer is 56", "56", 1.0),
        ("integer", "56, no wait, 54", "56", 0.0),
        ("first_integer", "56, no wait, 54", "56", 1.0),
        ("integer", "no digits", "3", 0.0),
        ("math", "so the result is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("math", "the result is \\boxed{3}", "4", 0.0),
        ("exact", " yes ", "yes", 1.0),
    ],
)
def test_builtin_rewards(rm_type, response, label, expected):
    rm = RewardModel(RewardConfig(rm_type, None, "raise"))
    assert asyncio.run(rm.score(_sample(response, label))) == expected


def flaky_reward(sample):
    if sample.response == "boom":
        raise ValueError("verifier crashed")
    return 1.0


async def async_reward(sample):
    return 0.25


def test_custom_reward_sync_and_async():
    rm = RewardModel(RewardConfig(None, "tests.unit.test_data_and_rewards:async_reward", "raise"))
    assert asyncio.run(rm.score(_sample("x", "1"))) == 0.25


def test_reward_error_policy_raise_names_the_sample():
    rm = RewardModel(RewardConfig(None, "tests.unit.test_data_and_rewards:flaky_reward", "raise"))
    with pytest.raises(RewardError, match="uid=u .*verifier crashed"):
        asyncio.run(rm.score(_sample("boom", "1")))


def test_reward_error_policy_zero_counts_errors():
    rm = RewardModel(RewardConfig(None, "tests.unit.test_data_and_rewards:flaky_reward", "zero"))
    assert asyncio.run(rm.score(_sample("boom", "1"))) == 0.0
    assert asyncio.run(rm.score(_sample("fine", "1"))) == 1.0
    assert rm.errors == 1
