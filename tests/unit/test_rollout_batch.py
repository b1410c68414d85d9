"""The batch record that crosses Ray from the rollout executor to the trainers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from miles_async.rollout.batch import RolloutBatch, to_train_batch
from miles_async.rollout.sample import Sample


def _samples() -> list[list[Sample]]:
    def sample(uid: str, g: int, i: int, response: list[int]) -> Sample:
        return Sample(
            uid=uid,
            group_index=g,
            index=i,
            prompt="",
            prompt_tokens=[1, 2],
            response_tokens=response,
            rollout_logprobs=[-1.0] * len(response),
            weight_versions=[3] * len(response),
            reward=float(i),
        )

    return [[sample("a", 0, 0, [5, 6]), sample("a", 0, 1, [7])], [sample("b", 1, 0, [8, 9, 10])]]


def test_samples_become_columns_and_survive_pickling():
    batch = to_train_batch(_samples())
    assert isinstance(batch, RolloutBatch) and len(batch) == 3
    assert batch.tokens == [[1, 2, 5, 6], [1, 2, 7], [1, 2, 8, 9, 10]]
    assert (batch.prompt_lengths, batch.response_lengths) == ([2, 2, 2], [2, 1, 3])
    assert batch.loss_masks == [[1, 1], [1], [1, 1, 1]]
    assert (batch.rewards, batch.group_index, batch.uids) == ([0.0, 1.0, 0.0], [0, 0, 1], ["a", "a", "b"])
    assert pickle.loads(pickle.dumps(batch)) == batch  # what ray.put and every worker's ray.get do


def test_a_malformed_batch_is_refused_naming_the_column_or_the_sample():
    groups = _samples()
    groups[1][0].loss_mask = [1, 1]  # e.g. a custom generate function's mask, one token short
    with pytest.raises(ValueError, match=r"sample uid=b \(index 2\) has a loss mask of 2 for 3 response tokens"):
        to_train_batch(groups)
    batch = to_train_batch(_samples())
    with pytest.raises(ValueError, match=r"RolloutBatch: 2 rewards for 3 samples"):
        dataclasses.replace(batch, rewards=[1.0, 0.0])
    with pytest.raises(
        ValueError, match=r"sample uid=a \(index 1\) has 4 tokens for a prompt of 2 and a response of 1"
    ):
        dataclasses.replace(batch, tokens=[[1, 2, 5, 6], [1, 2, 7, 7], [1, 2, 8, 9, 10]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.rewards = [0.0] * 3  # type: ignore[misc]
