"""Staleness control for fully-async training, driven through the real ``FullyAsyncProducer``.

The producer runs as in a run: the real data source, rollout driver, reward model, staleness
manager and batch assembler. Two things stand in for what a unit test cannot hold:

* the engine is a scripted generate function, plugged in where ``--custom-generate-function-path``
  plugs one in: each request takes a scripted time, and its first token carries the weight
  version the engine served when the request started, its last the version when it ended (an
  in-place weight update in the middle of a request);
* the event loop's clock is virtual: timers fire in order, but no real time passes, so the
  straggler scenarios run in milliseconds and the same seed always gives the same run. A state
  in which every task waits and no timer is due raises instead of hanging.

The trainer is the loop's part: take a batch, train for a while, push the weights to the
engine, and only then tell the producer (``on_step``), as ``weights/driver.py`` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import selectors
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_async.assets.tiny_model import build_tiny_tokenizer
from miles_async.config import DataConfig, RewardConfig
from miles_async.rollout.data_source import DataSource, PromptItem
from miles_async.rollout.filters import BatchAssembler, starved_by_filter
from miles_async.rollout.fully_async import FullyAsyncProducer, ProducerError
from miles_async.rollout.generate import GenerateContext
from miles_async.rollout.rewards import RewardModel
from miles_async.rollout.rollout import RolloutContext
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.rollout.staleness import StalenessManager

FAST = settings(max_examples=60, deadline=None)
ROLLOUT_TIMEOUT = 3600.0  # virtual seconds; the loop waits for a batch this long, as train_async.py does


# ---------------------------------------------------------------------------------------------
# The harness: a virtual clock, a scripted engine, a trainer
# ---------------------------------------------------------------------------------------------


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: waiting for the next timer moves the virtual clock to it instead."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def select(self, timeout=None):
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("deadlock: every task waits and no timer is due")
            self.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(coro):
    # The Runner, like asyncio.run, cancels and awaits what is left before closing the loop.
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


class ScriptedEngine:
    """A generate function with scripted durations; the answer "1" scores 1 against the label "1".

    Sample 0 of a group answers "1", the others "0", unless ``zero_variance(group_index)`` says
    the whole group answers "1" (and the zero-variance filter drops it).
    """

    def __init__(
        self,
        duration: Callable[[Sample], float],
        zero_variance: Callable[[int], bool] = lambda g: False,
        record_versions: bool = True,
        mask_first_token: bool = False,
    ):
        self.duration = duration
        self.zero_variance = zero_variance
        self.record_versions = record_versions
        self.mask_first_token = mask_first_token
        self.version = 0  # the weights the engine serves
        self.in_flight = 0
        self.started_at_version: dict[tuple[int, int], int] = {}  # (group index, sample index) -> version

    async def generate(self, ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
        first = self.version
        self.started_at_version[(sample.group_index, sample.index)] = first
        self.in_flight += 1
        await asyncio.sleep(self.duration(sample))
        self.in_flight -= 1
        sample.response_tokens, sample.rollout_logprobs = [7, 8], [-1.0, -1.0]
        sample.weight_versions = [first, self.version] if self.record_versions else []
        if self.mask_first_token:
            sample.loss_mask = [0, 1]
        sample.response = "1" if sample.index == 0 or self.zero_variance(sample.group_index) else "0"
        sample.status = SampleStatus.COMPLETED
        return sample


@cache
def tokenizer():
    return build_tiny_tokenizer()


def make_producer(
    engine: ScriptedEngine,
    *,
    batch: int,
    stale: int,
    conc: int,
    n_prompts: int = 64,
    n_samples: int = 2,
    seed: int = 0,
    metadata: dict | None = None,
) -> FullyAsyncProducer:
    """Built as ``ray/rollout_executor.py`` builds it; call inside the running (virtual) loop."""
    items = [PromptItem(f"p{i}", f"q{i}", "1", dict(metadata or {})) for i in range(n_prompts)]
    data = DataSource(DataConfig("unused", "prompt", "label", "metadata", False, None, True, seed), batch, items)
    ctx = RolloutContext(
        data,
        GenerateContext(None, tokenizer()),
        engine.generate,
        RewardModel(RewardConfig("exact", None, "raise")),
        False,
        n_samples,
        {"max_new_tokens": 2},
        asyncio.Semaphore(1000),
    )
    return FullyAsyncProducer(
        ctx,
        data,
        StalenessManager(conc, batch, stale),
        BatchAssembler(batch, 0.0),
        60.0,
        ROLLOUT_TIMEOUT,
        clock=asyncio.get_running_loop().time,
    )


@dataclass
class Step:
    step: int
    groups: list[list[Sample]]
    epochs: list[int]
    metrics: dict
    in_flight_when_taken: int = 0
    started_while_training: int = 0  # requests


async def train(
    producer: FullyAsyncProducer,
    engine: ScriptedEngine,
    n_steps: int,
    train_time: float = 1.0,
    update_time: float = 0.0,
) -> list[Step]:
    steps = []
    for step in range(producer.current_step, producer.current_step + n_steps):
        batch = await asyncio.wait_for(producer.get_batch(), ROLLOUT_TIMEOUT)
        record = Step(step, *batch, in_flight_when_taken=engine.in_flight)
        started = len(engine.started_at_version)
        await asyncio.sleep(train_time)
        record.started_while_training = len(engine.started_at_version) - started
        engine.version = step + 1  # the engines serve the new weights ...
        await asyncio.sleep(update_time)  # ... a moment before the producer hears of it
        producer.on_step(step + 1)
        steps.append(record)
    return steps


def run_steps(
    engine: ScriptedEngine, n_steps: int, train_time: float = 1.0, update_time: float = 0.0, **kw
) -> tuple[list[Step], FullyAsyncProducer]:
    async def main():
        producer = make_producer(engine, **kw)
        try:
            return await train(producer, engine, n_steps, train_time, update_time), producer
        finally:
            await producer.stop()

    return run_virtual(main())


def oldest_token_age(step: Step) -> int:
    """Measured from the recorded versions, independently of the producer's own arithmetic."""
    return max(step.step - min(s.weight_versions) for g in step.groups for s in g)


def seeded(seed: int, *key) -> random.Random:
    return random.Random("/".join(map(str, (seed, *key))))


# ---------------------------------------------------------------------------------------------
# The staleness bound, under random completion order
# ---------------------------------------------------------------------------------------------

sim_params = dict(
    conc=st.integers(1, 12),
    batch=st.integers(1, 4),
    stale=st.integers(0, 3),
    filter_p=st.sampled_from([0.0, 0.3, 0.7]),
    seed=st.integers(0, 2**32 - 1),
    train_time=st.sampled_from([0.1, 1.0, 5.0]),
    update_time=st.sampled_from([0.0, 0.5]),
)


@FAST
@given(**sim_params)
def test_random_durations_never_train_a_token_beyond_the_staleness_bound(
    conc, batch, stale, filter_p, seed, train_time, update_time
):
    engine = ScriptedEngine(
        duration=lambda s: (
            seeded(seed, s.group_index, s.index).expovariate(1.0) * seeded(seed, s.group_index).choice([0.2, 1.0, 10.0])
        ),
        zero_variance=lambda g: seeded(seed, "zv", g).random() < filter_p,
    )
    steps, producer = run_steps(engine, 8, train_time, update_time, batch=batch, stale=stale, conc=conc, seed=seed)
    assert [len(s.groups) for s in steps] == [batch] * 8
    for s in steps:
        assert oldest_token_age(s) <= stale
        assert s.metrics["async/staleness_max"] == oldest_token_age(s)


@FAST
@given(**sim_params)
def test_in_order_completion_needs_no_regeneration(conc, batch, stale, filter_p, seed, train_time, update_time):
    # Groups finishing in submission order: the capacity rule alone bounds staleness.
    engine = ScriptedEngine(duration=lambda s: 1.0, zero_variance=lambda g: seeded(seed, "zv", g).random() < filter_p)
    steps, producer = run_steps(engine, 8, train_time, update_time, batch=batch, stale=stale, conc=conc, seed=seed)
    assert all(oldest_token_age(s) <= stale for s in steps)
    assert producer.stale_regenerated == 0


@FAST
@given(
    conc=st.integers(1, 12),
    batch=st.integers(1, 4),
    filter_p=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**32 - 1),
    train_time=st.sampled_from([0.1, 5.0]),
)
def test_zero_staleness_is_strictly_synchronous(conc, batch, filter_p, seed, train_time):
    engine = ScriptedEngine(
        duration=lambda s: seeded(seed, s.group_index, s.index).expovariate(1.0) * 5,
        zero_variance=lambda g: seeded(seed, "zv", g).random() < filter_p,
    )
    steps, producer = run_steps(engine, 6, train_time, batch=batch, stale=0, conc=conc, seed=seed)
    # Every trained token comes from the weights of the very step that trains it, nothing
    # generates while the trainer works, and nothing ever had to be thrown away for staleness.
    assert all(v == s.step for s in steps for g in s.groups for smp in g for v in smp.weight_versions)
    assert all(s.in_flight_when_taken == 0 and s.started_while_training == 0 for s in steps)
    assert producer.stale_regenerated == 0


@settings(max_examples=30, deadline=None)
@given(conc=st.integers(1, 8), batch=st.integers(1, 4), stale=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_heavy_filtering_still_makes_progress(conc, batch, stale, seed):
    engine = ScriptedEngine(
        duration=lambda s: seeded(seed, s.group_index).uniform(0.1, 3.0),
        zero_variance=lambda g: seeded(seed, "zv", g).random() < 0.9,
    )
    # 400 prompts: a full pass of drops in a row (the starvation rule) is out of reach at 90%.
    steps, producer = run_steps(engine, 5, batch=batch, stale=stale, conc=conc, seed=seed, n_prompts=400)
    assert [len(s.groups) for s in steps] == [batch] * 5
    assert producer.assembler.dropped > 0


def straggler_engine(**kw) -> ScriptedEngine:
    """Group 1 takes 6.5 s, every other group 1 s, a step's training 1 s: with batch 1 the groups
    after it fill steps 0, 1 and 2, and it finishes at step 3, with tokens of versions 0 and 3."""
    return ScriptedEngine(duration=lambda s: 6.5 if s.group_index == 1 else 1.0, **kw)


def test_a_straggler_past_the_bound_is_regenerated_not_trained():
    engine = straggler_engine()
    steps, producer = run_steps(engine, 6, batch=1, stale=1, conc=2)
    assert producer.stale_regenerated >= 1
    assert all(g[0].group_index != 1 for s in steps for g in s.groups)
    assert all(oldest_token_age(s) <= 1 for s in steps)


def test_tokens_out_of_the_loss_do_not_count_towards_staleness():
    # The straggler's first token comes from version 0 and is masked out of the loss (as
    # --mask-offpolicy-in-partial-rollout does); what is trained is from the newest weights.
    engine = straggler_engine(mask_first_token=True)
    steps, producer = run_steps(engine, 6, batch=1, stale=1, conc=2)
    straggler = [(s, g) for s in steps for g in s.groups if g[0].group_index == 1]
    assert len(straggler) == 1 and producer.stale_regenerated == 0
    step, group = straggler[0]
    assert step.step - group[0].weight_versions[0] > 1  # the masked token is older than the bound
    assert step.metrics["async/staleness_max"] == 0  # and the metrics measure what is trained


def test_a_generate_function_without_versions_is_bounded_by_the_submission_step():
    engine = straggler_engine(record_versions=False)
    steps, producer = run_steps(engine, 6, batch=1, stale=1, conc=2)
    assert producer.stale_regenerated >= 1
    for s in steps:
        for g in s.groups:
            assert s.step - engine.started_at_version[(g[0].group_index, 0)] <= 1
            assert s.metrics["async/staleness_max"] <= 1


# ---------------------------------------------------------------------------------------------
# The producer's own record, the zero-variance filter, resume
# ---------------------------------------------------------------------------------------------


def test_the_datasets_metadata_is_never_overwritten():
    user = {"epoch": "from the dataset", "submitted_at_step": ["also", "the dataset's"]}
    engine = straggler_engine()
    # 8 prompts, batch 2: 12 steps cross into epoch 2, with a straggler regenerated on the way.
    steps, producer = run_steps(engine, 12, batch=2, stale=1, conc=3, n_prompts=8, metadata=user)
    assert producer.stale_regenerated >= 1
    assert all(smp.metadata == user for s in steps for g in s.groups for smp in g)
    assert {e for s in steps for e in s.epochs} == {0, 1, 2}
    for epoch in (0, 1):
        assert len([g for s in steps for g, e in zip(s.groups, s.epochs) if e == epoch]) == 8


def test_starved_by_filter_is_a_full_pass_of_drops_in_a_row():
    assert not starved_by_filter(63, 64) and starved_by_filter(64, 64)
    assert not starved_by_filter(99, 100) and starved_by_filter(100, 100)
    # a small data set still needs 64 drops in a row: a few can happen by chance
    assert not starved_by_filter(63, 6) and starved_by_filter(64, 6)
    asm = BatchAssembler(1, 0.0)
    for rewards, in_a_row in (([1.0, 1.0], 1), ([0.0, 0.0], 2), ([0.0, 1.0], 0), ([1.0, 1.0], 1)):
        asm.add([Sample("u", 0, i, "p", reward=r) for i, r in enumerate(rewards)])
        assert asm.dropped_in_a_row == in_a_row


def test_a_filter_that_keeps_nothing_fails_naming_it_instead_of_waiting_for_the_timeout():
    async def main():
        engine = ScriptedEngine(duration=lambda s: 1.0, zero_variance=lambda g: g > 6)
        # One group at a time, so the drop that trips the rule is the last one counted.
        producer = make_producer(engine, batch=2, stale=1, conc=1, n_prompts=16)
        try:
            trained = await train(producer, engine, 3)  # groups 1..6 are informative: 3 batches
            with pytest.raises(
                ProducerError,
                match=r"--zero-variance-filter dropped 64 groups in a row, at least a full pass "
                r"over the 16 prompts.*\[1\.0, 1\.0\]",
            ):
                await asyncio.wait_for(producer.get_batch(), ROLLOUT_TIMEOUT)
            return trained, producer, asyncio.get_running_loop().time()
        finally:
            await producer.stop()

    trained, producer, elapsed = run_virtual(main())
    assert len(trained) == 3 and producer.assembler.dropped == 64
    assert elapsed < 120  # ~70 s of scripted generation (64 drops of 1 s), not the hour of the rollout timeout


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(6, 20),
    batch=st.integers(1, 3),
    stale=st.integers(0, 2),
    conc=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    crash=st.integers(1, 3),
)
def test_a_resumed_producer_trains_every_prompt_of_an_epoch_once(n, batch, stale, conc, seed, crash):
    engine = ScriptedEngine(
        duration=lambda s: seeded(seed, s.group_index).uniform(0.1, 5.0),
        zero_variance=lambda g: seeded(seed, "zv", g).random() < 0.3,
    )
    common = dict(batch=batch, stale=stale, conc=conc, n_prompts=n, seed=seed)

    async def main():
        first = make_producer(engine, **common)
        before = await train(first, engine, crash)
        state = json.loads(json.dumps(first.state_dict(trained_steps=crash)))
        await first.stop()  # killed: whatever was in flight or buffered is lost
        resumed = make_producer(engine, **common)
        resumed.load_state_dict(state)
        try:
            after = await train(resumed, engine, 2 * n // batch + 2)  # well into the third epoch
        finally:
            await resumed.stop()
        return before, after, first.consumed.get(0, set()) | resumed.consumed.get(0, set())

    before, after, consumed_in_epoch_0 = run_virtual(main())
    trained = [(e, g[0].uid) for s in before + after for g, e in zip(s.groups, s.epochs)]
    assert len(trained) == len(set(trained)), "a prompt was trained twice in one epoch"
    assert [s.step for s in after] == list(range(crash, crash + len(after)))
    assert consumed_in_epoch_0 == {f"p{i}" for i in range(n)}  # every prompt trained or filtered
