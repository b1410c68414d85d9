"""DAPO dynamic sampling's pure parts: loading a filter by dotted path, the built-in zero-variance filter, a
filter's verdict, the data source's give-back, and the round logic of a rollout (driven with real asyncio
tasks whose groups finish in a scripted order)."""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.config import DataConfig
from miles_async.config.declare import ConfigError
from miles_async.rollout.data_source import DataError, DataSource, PromptItem
from miles_async.rollout.dynamic_sampling import DynamicSampler, FilterStarvedError
from miles_async.rollout.filters import (
    BatchAssembler,
    DynamicFilterOutput,
    load_group_filter,
    verdict,
    zero_variance,
)
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.plugins import PluginError
from tests.flag_helpers import minimal_flags

ARGS = SimpleNamespace(zero_variance_tol=1e-6)


def group(uid: str, rewards: list[float]) -> list[Sample]:
    return [Sample(uid, 0, i, "p", reward=r) for i, r in enumerate(rewards)]


# Loaded by dotted path below: a filter written for Miles/slime (``get_reward_value``, a tensor ``keep``).
class _MilesOutput:
    def __init__(self, keep, reason=None):
        self.keep, self.reason = keep, reason


def miles_style_filter(args, samples, **kwargs):
    rewards = [s.get_reward_value(args) for s in samples]
    keep = torch.tensor(rewards, dtype=torch.float).std() > 0.0
    return _MilesOutput(keep, None if keep else f"zero_std_{round(rewards[0], 1)}")


def keeps_even_uids(args, samples):
    return int(samples[0].uid[1:]) % 2 == 0


# -- filters ----------------------------------------------------------------------------------------
def test_a_miles_filter_loads_by_dotted_path_and_its_tensor_verdict_is_read():
    f = load_group_filter("tests.unit.test_dynamic_sampling:miles_style_filter", ARGS)
    assert f(group("a", [0.0, 1.0])) == DynamicFilterOutput(True, None)
    assert f(group("a", [1.0, 1.0])) == DynamicFilterOutput(False, "zero_std_1.0")
    assert f.name == "--dynamic-sampling-filter-path tests.unit.test_dynamic_sampling:miles_style_filter"
    assert load_group_filter("tests.unit.test_dynamic_sampling.keeps_even_uids", ARGS)(group("p3", [1.0])).keep is False


@pytest.mark.parametrize("path", ["tests.unit.test_dynamic_sampling:nope", "no_such_module_xyz:f", "justname"])
def test_a_bad_filter_path_names_the_flag(path):
    with pytest.raises(PluginError, match="--dynamic-sampling-filter-path"):
        load_group_filter(path, ARGS)


MILES_FILTERS = "miles.rollout.filter_hub.dynamic_sampling_filters."


def test_miles_own_filter_paths_load_our_equivalents_and_say_so(tmp_path, caplog):
    """Miles' launchers give paths into Miles' tree (16 pass check_reward_nonzero_std, 7 check_no_aborted), which
    cannot be imported here; each loads the same function of ours, and the alias is logged."""
    nonzero_std = load_group_filter(MILES_FILTERS + "check_reward_nonzero_std", ARGS)
    assert nonzero_std(group("a", [1.0, 1.0])) == DynamicFilterOutput(False, "zero_std_1.0")
    assert nonzero_std(group("a", [0.0, 1.0])).keep
    no_aborted = load_group_filter(MILES_FILTERS + "check_no_aborted", ARGS)
    cut = group("b", [1.0, 0.0])
    assert no_aborted(cut).keep
    cut[1].status = SampleStatus.ABORTED
    assert no_aborted(cut) == DynamicFilterOutput(False, "group_has_aborted")
    with caplog.at_level(logging.INFO, logger="miles_async.utils.plugins"):
        cfg = parse_args(
            [
                *minimal_flags(tmp_path),
                "--num-rollout",
                "1",
                "--dynamic-sampling-filter-path",
                MILES_FILTERS + "check_reward_nonzero_std",
            ]
        )
    assert cfg.rollout.dynamic_sampling.filter_path == MILES_FILTERS + "check_reward_nonzero_std"
    assert [r.getMessage() for r in caplog.records if r.name == "miles_async.utils.plugins"] == [
        f"--dynamic-sampling-filter-path {MILES_FILTERS}check_reward_nonzero_std: Miles' own function, loaded as "
        "its equivalent here, miles_async.rollout.filters:zero_variance"
    ]


def test_the_built_in_zero_variance_filter():
    assert zero_variance(ARGS, group("a", [1.0, 1.0])) == DynamicFilterOutput(False, "zero_std_1.0")
    assert zero_variance(ARGS, group("a", [0.0, 1.0])).keep
    assert zero_variance(ARGS, group("a", [0.5, 0.5 + 1e-9])).keep is False  # within --zero-variance-tol
    assert zero_variance(SimpleNamespace(zero_variance_tol=0.2), group("a", [0.0, 0.1])).keep is False
    assert zero_variance(ARGS, group("a", [3.0])).keep  # a singleton has no baseline to vary around
    with pytest.raises(ValueError, match="non-finite"):
        zero_variance(ARGS, group("a", [float("nan"), 1.0]))


def test_a_verdict_is_a_bool_or_has_keep_and_anything_else_is_refused_by_name():
    assert verdict(True) == DynamicFilterOutput(True)
    assert verdict(np.bool_(False)) == DynamicFilterOutput(False, "filtered")
    assert verdict(torch.tensor(True)).keep is True
    assert verdict(DynamicFilterOutput(False, "why")) == DynamicFilterOutput(False, "why")
    for bad in (None, "yes", [True]):
        with pytest.raises(TypeError, match="--zero-variance-filter: a filter returns a bool"):
            verdict(bad, "--zero-variance-filter")
    with pytest.raises(TypeError, match="not a single truth value"):
        verdict(torch.tensor([True, False]))


def test_the_assembler_applies_a_loaded_filter_and_records_why():
    asm = BatchAssembler(1, None, load_group_filter("tests.unit.test_dynamic_sampling:keeps_even_uids", ARGS))
    assert asm.add(group("p1", [0.0, 1.0])) == "dropped" and asm.last_reason == "filtered"
    assert asm.add(group("p2", [1.0, 1.0])) == "kept"  # the custom filter, not zero variance, decides
    assert (asm.kept, asm.dropped, asm.filter_name) == (
        1,
        1,
        "--dynamic-sampling-filter-path tests.unit.test_dynamic_sampling:keeps_even_uids",
    )


# -- flags ------------------------------------------------------------------------------------------
@pytest.fixture
def base(tmp_path):
    return [*minimal_flags(tmp_path), "--num-rollout", "2"]


def test_flags_build_the_dynamic_sampling_config(base):
    assert parse_args(base).rollout.dynamic_sampling is None  # nothing given: each rollout draws one batch
    path = "tests.unit.test_dynamic_sampling:miles_style_filter"
    ds = parse_args([*base, "--dynamic-sampling-filter-path", path, "--over-sampling-batch-size", "6"])
    assert ds.rollout.dynamic_sampling.filter_path == path
    assert ds.rollout.dynamic_sampling.over_sampling_batch_size == 6
    assert parse_args([*base, "--zero-variance-filter"]).rollout.dynamic_sampling.over_sampling_batch_size == 4
    with pytest.raises(PluginError, match="--dynamic-sampling-filter-path: module 'tests.unit.test_dynamic_sampling'"):
        parse_args([*base, "--dynamic-sampling-filter-path", "tests.unit.test_dynamic_sampling:missing"])
    with pytest.raises(ConfigError, match="give one filter"):
        parse_args([*base, "--zero-variance-filter", "--dynamic-sampling-filter-path", path])
    with pytest.raises(ConfigError, match="need the built-in data source.*--data-source-path tests.integration"):
        parse_args([*base, "--zero-variance-filter", "--data-source-path", "tests.integration.plugins.CountingSource"])
    with pytest.raises(ConfigError, match="--over-sampling-batch-size must be >= 1"):
        parse_args([*base, "--over-sampling-batch-size", "0"])
    warned = parse_args([*base, "--fully-async", "--over-sampling-batch-size", "8"]).warnings
    assert any(w.startswith("--over-sampling-batch-size 8 is ignored") for w in warned), warned
    assert any(
        "--zero-variance-tol 0.1 is ignored" in w for w in parse_args([*base, "--zero-variance-tol", "0.1"]).warnings
    )


# -- the data source's give-back ----------------------------------------------------------------------
def source(n: int, seed: int = 0) -> DataSource:
    items = [PromptItem(f"p{i}", f"q{i}", "1", {}) for i in range(n)]
    return DataSource(DataConfig("unused", "prompt", "label", None, False, None, True, seed), 2, items)


def test_given_back_prompts_come_first_in_their_epoch_and_survive_a_checkpoint():
    ds = source(3)
    drawn = [ds.draw() for _ in range(4)]  # the whole of epoch 0, then the first of epoch 1
    assert [e for e, _ in drawn] == [0, 0, 0, 1]
    ds.give_back([drawn[1], drawn[3]])
    state = ds.state_dict()
    assert state["given_back"] == [[0, drawn[1][1].uid], [1, drawn[3][1].uid]]
    resumed = source(3)
    resumed.load_state_dict(state)
    for d in (ds, resumed):
        assert d.draw() == drawn[1] and d.draw() == drawn[3]
        assert d.draw()[0] == 1 and d.num_given_back() == 0
    with pytest.raises(DataError, match="--load: the checkpoint gives back prompt uid 'zz'"):
        source(3).load_state_dict({**state, "given_back": [[0, "zz"]]})
    # the batch draw (no dynamic sampling) hands them out too: a flag dropped on resume loses no prompt
    plain = source(3)
    plain.load_state_dict(state)
    assert [i.uid for i in plain.next_batch()] == [drawn[1][1].uid, drawn[3][1].uid]


# -- the round logic --------------------------------------------------------------------------------
class Script:
    """Groups of two samples; a uid in ``flat`` gets equal rewards; durations are drawn per (uid, epoch draw)."""

    def __init__(self, flat: set[str], seed: int = 0, fail: str | None = None):
        self.flat, self.rng, self.fail = flat, random.Random(seed), fail
        self.started: list[str] = []
        self.cancelled = 0

    async def make_group(self, item: PromptItem, index: int) -> list[Sample]:
        self.started.append(item.uid)
        try:
            await asyncio.sleep(self.rng.uniform(0, 0.004))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if item.uid == self.fail:
            raise RuntimeError(f"induced failure on {item.uid}")
        rewards = [1.0, 1.0] if item.uid in self.flat else [0.0, 1.0]
        return [Sample(item.uid, index, i, item.prompt, reward=r) for i, r in enumerate(rewards)]


def _zv_filter():
    return load_group_filter("miles_async.rollout.filters.zero_variance", ARGS, "--zero-variance-filter")


@pytest.mark.parametrize("over_sampling", [1, 2, 5])
def test_every_rollout_keeps_a_full_batch_and_each_prompt_is_consumed_once_per_epoch(over_sampling):
    n, batch = 10, 2
    flat = {f"p{i}" for i in range(0, n, 3)}  # p0, p3, p6, p9: zero variance
    ds, script = source(n, seed=1), Script(flat, seed=over_sampling)
    sampler = DynamicSampler(_zv_filter(), batch, over_sampling)
    consumed: list[tuple[int, str]] = []

    async def main():
        for _ in range(12):  # several epochs of 10 prompts
            groups = await sampler.sample(ds, script.make_group)
            report = sampler.take_report()
            assert len(groups) == batch and [g[0].group_index for g in groups] == list(range(batch))
            assert all(len({s.reward for s in g}) == 2 for g in groups)  # nothing zero-variance kept
            assert all(d.uid in flat and d.reason == "zero_std_1.0" for d in report.dropped)
            consumed.extend(zip(report.epochs, (g[0].uid for g in groups)))
            consumed.extend((d.epoch, d.uid) for d in report.dropped)
            assert report.given_back == ds.num_given_back()

    asyncio.run(main())
    pending = [(e, i.uid) for e, i in (ds.draw() for _ in range(ds.num_given_back()))]  # drawn again next
    assert len(consumed) == len(set(consumed)), "a prompt was consumed twice in one epoch"
    assert not set(pending) & set(consumed)
    last = max(e for e, _ in consumed)
    assert last >= 2
    for epoch in range(last):  # every finished epoch: each prompt trained, filtered or still to come, once
        assert sorted(u for e, u in consumed + pending if e == epoch) == sorted(f"p{i}" for i in range(n)), epoch
    if over_sampling > 1:
        assert script.cancelled > 0  # the slow tail really was cut and given back


def test_without_a_filter_over_sampling_trains_the_first_groups_to_finish():
    ds, script = source(8), Script(flat={"p0", "p1"})
    sampler = DynamicSampler(None, 3, 6)
    groups = asyncio.run(sampler.sample(ds, script.make_group))
    report = sampler.take_report()
    assert len(groups) == 3 and report.dropped == [] and report.rounds == 1
    assert report.given_back == 3 and ds.num_given_back() == 3


def test_a_filter_that_keeps_nothing_fails_after_a_full_pass_naming_it():
    ds = source(80)
    script = Script(flat={f"p{i}" for i in range(80)})
    sampler = DynamicSampler(_zv_filter(), 4, 4)

    async def main():
        return await asyncio.wait_for(sampler.sample(ds, script.make_group), 30)

    with pytest.raises(
        FilterStarvedError,
        match=r"--zero-variance-filter dropped 80 groups in a row, at least a full "
        r"pass over the 80 prompts.*\[1\.0, 1\.0\]",
    ):
        asyncio.run(main())
    assert sampler.dropped_in_a_row == 80 and len(script.started) < 80 + 8


def test_a_failed_group_fails_the_rollout_and_gives_the_rest_back():
    ds = source(6, seed=3)
    failing = f"p{ds._order[0]}"
    script = Script(flat=set(), fail=failing)
    script.rng = SimpleNamespace(uniform=lambda a, b: 0.0)  # the failing group, first drawn, finishes first
    sampler = DynamicSampler(_zv_filter(), 4, 4)
    with pytest.raises(RuntimeError, match=f"induced failure on {failing}"):
        asyncio.run(sampler.sample(ds, script.make_group))
    back = [ds.draw() for _ in range(ds.num_given_back())]
    assert [i.uid for _, i in back] == [f"p{j}" for j in ds._order[1:4]] and all(e == 0 for e, _ in back)
