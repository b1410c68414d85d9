"""The staleness core and the batch assembler on their own: ``staleness_of`` (the one definition of
staleness, for the bound and the metrics), ``StalenessManager``'s capacity accounting (a state machine
checked by hypothesis) and the zero-variance filter. The producer that uses them is driven whole in
test_staleness.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from miles_async.rollout.filters import BatchAssembler, zero_variance_groups
from miles_async.rollout.sample import Sample
from miles_async.rollout.staleness import StalenessManager, staleness_of

# ---------------------------------------------------------------------------------------------
# The one definition of staleness
# ---------------------------------------------------------------------------------------------


def sample(versions: list[int], mask: list[int] | None = None, n_tokens: int | None = None) -> Sample:
    n = len(versions) if n_tokens is None else n_tokens
    return Sample("u", 0, 0, "p", response_tokens=[1] * n, weight_versions=versions, loss_mask=mask)


def test_staleness_of_counts_the_oldest_trained_token():
    assert staleness_of(sample([5, 4, 3]), 5, unrecorded_version=0) == 2
    assert staleness_of(sample([2, 5], mask=[0, 1]), 5, unrecorded_version=0) == 0  # not trained
    assert staleness_of(sample([2, 5], mask=[0, 0]), 5, unrecorded_version=0) == 0  # nothing trained
    assert staleness_of(sample([6]), 5, unrecorded_version=0) == 0  # served before on_step caught up
    assert staleness_of(sample([], n_tokens=3), 5, unrecorded_version=2) == 3
    assert staleness_of(sample([], n_tokens=0), 5, unrecorded_version=2) == 0
    with pytest.raises(ValueError, match="uid=u: 1 weight versions but a loss mask of 2"):
        staleness_of(sample([1], mask=[1, 1]), 3, unrecorded_version=0)


# ---------------------------------------------------------------------------------------------
# StalenessManager
# ---------------------------------------------------------------------------------------------


def counts(m: StalenessManager) -> tuple[int, ...]:
    return (m.current_step, m.submitted, m.accepted, m.running, m.filtered)


@pytest.mark.parametrize("args", [(0, 1, 0), (1, 0, 0), (1, 1, -1), (1.5, 1, 0), (True, 1, 0), (1, 1, None)])
def test_constructor_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        StalenessManager(*args)


def test_capacity_formula_and_synchronous_budget():
    m = StalenessManager(max_concurrent_groups=100, batch_size=4, max_staleness_steps=0)
    assert m.capacity() == 4  # exactly the batch of step 0
    for _ in range(4):
        assert m.try_submit()
    assert not m.try_submit() and m.capacity() == 0
    m.on_accepted()
    m.on_filtered()  # a dropped group is replaced, not waited for
    assert m.capacity() == 1 and m.try_submit()
    for _ in range(4):
        m.on_accepted()
    with pytest.raises(ValueError):
        m.on_step(2)  # only one batch exists
    m.on_step(1)
    assert m.capacity() == 4 and m.pending == 0


def test_capacity_is_capped_by_concurrency_and_runs_ahead_by_staleness():
    m = StalenessManager(max_concurrent_groups=3, batch_size=2, max_staleness_steps=2)
    assert m.capacity() == 3
    submitted = 0
    while m.try_submit():
        submitted += 1
        m.on_accepted()
    assert submitted == 6 == (2 + 0 + 1) * 2  # s + 1 batches ahead of training, no more
    m.on_step(1)
    assert m.capacity() == 2


def test_protocol_misuse_raises_and_changes_nothing():
    m = StalenessManager(2, 2, 1)
    before = counts(m)
    for call in (m.on_accepted, m.on_filtered):
        with pytest.raises(RuntimeError):
            call()
    assert counts(m) == before
    for _ in range(2):
        m.try_submit()
        m.on_accepted()
    m.on_step(1)
    with pytest.raises(RuntimeError):
        m.on_filtered()  # both accepted groups were trained by step 0
    with pytest.raises(ValueError):
        m.on_step(0)
    with pytest.raises(ValueError):
        m.on_step("2")  # type: ignore[arg-type]
    m.on_step(1)  # repeating the current step is harmless


def test_resume_at_step_without_a_saved_state():
    m = StalenessManager(4, 2, 1)
    with pytest.raises(ValueError):
        m.on_step(3)  # a fresh manager never saw the 6 groups of 3 steps
    m.resume_at_step(3)
    m.on_step(3)
    assert (m.current_step, m.accepted, m.pending, m.capacity()) == (3, 6, 0, 4)
    with pytest.raises(RuntimeError):
        m.resume_at_step(4)
    with pytest.raises(ValueError):
        StalenessManager(4, 2, 1).resume_at_step(-1)


class StalenessMachine(RuleBasedStateMachine):
    """Any interleaving of the events the producer sends keeps the counts consistent."""

    @initialize(conc=st.integers(1, 8), batch=st.integers(1, 5), stale=st.integers(0, 3))
    def setup(self, conc, batch, stale):
        self.m = StalenessManager(conc, batch, stale)
        self.model = dict(step=0, submitted=0, accepted=0, running=0, filtered=0)

    @rule()
    def submit(self):
        expected = self.m.capacity() > 0
        assert self.m.try_submit() == expected
        if expected:
            self.model["submitted"] += 1
            self.model["running"] += 1

    @precondition(lambda self: self.m.running > 0)
    @rule()
    def accept(self):
        self.m.on_accepted()
        self.model["running"] -= 1
        self.model["accepted"] += 1

    @precondition(lambda self: self.m.pending > 0)
    @rule()
    def filter(self):
        self.m.on_filtered()
        self.model["accepted"] -= 1
        self.model["filtered"] += 1

    @rule(data=st.data())
    def step(self, data):
        most = self.m.accepted // self.m.batch_size
        new = data.draw(st.integers(self.m.current_step, most), label="new_step")
        self.m.on_step(new)
        self.model["step"] = new

    @precondition(lambda self: self.m.current_step > 0)
    @rule()
    def step_backwards_fails(self):
        before = counts(self.m)
        with pytest.raises(ValueError):
            self.m.on_step(self.m.current_step - 1)
        assert counts(self.m) == before

    @rule()
    def step_past_accepted_fails(self):
        with pytest.raises(ValueError):
            self.m.on_step(self.m.accepted // self.m.batch_size + 1)

    @invariant()
    def consistent(self):
        m = self.m
        assert counts(m) == tuple(self.model.values())
        assert m.submitted == m.accepted + m.filtered + m.running
        assert m.running <= m.max_concurrent_groups and m.accepted >= m.trained
        assert m.accepted + m.running <= m.staleness_limit()
        assert m.capacity() == max(
            0,
            min(
                m.max_concurrent_groups - m.running,
                (m.max_staleness_steps + m.current_step + 1) * m.batch_size - (m.accepted + m.running),
            ),
        )


TestStalenessMachine = StalenessMachine.TestCase
TestStalenessMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# ---------------------------------------------------------------------------------------------
# filters.py
# ---------------------------------------------------------------------------------------------


def make_group(uid: str, rewards: list[float]) -> list[Sample]:
    return [Sample(uid=uid, group_index=0, index=i, prompt="p", reward=r) for i, r in enumerate(rewards)]


def test_zero_variance_groups():
    assert zero_variance_groups([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5 + 1e-9], [], [3.0]], tol=1e-6) == [
        True,
        False,
        True,
        True,
        True,
    ]
    assert zero_variance_groups([[0.0, 0.1]], tol=0.1) == [True]
    with pytest.raises(ValueError):
        zero_variance_groups([[0.0]], tol=-1.0)
    with pytest.raises(ValueError):
        zero_variance_groups([[float("nan"), 1.0]], tol=0.0)


def test_batch_assembler_counts_drops_and_keeps_completion_order():
    asm = BatchAssembler(2, tol=0.0)
    assert asm.add(make_group("a", [1.0, 1.0])) == "dropped"
    assert asm.add(make_group("b", [0.0, 1.0])) == "kept"
    assert not asm.ready()
    with pytest.raises(RuntimeError):
        asm.take()
    assert asm.add(make_group("c", [2.0])) == "kept"  # a singleton has no variance to filter on
    assert asm.add(make_group("d", [0.0, 0.5])) == "kept"
    assert asm.ready() and asm.num_ready() == 3
    assert [g[0].uid for g in asm.take()] == ["b", "c"]
    assert (asm.kept, asm.dropped, asm.num_ready()) == (3, 1, 1)


def test_batch_assembler_without_filter_and_eviction():
    asm = BatchAssembler(3, None)
    for uid in "abcd":
        assert asm.add(make_group(uid, [1.0, 1.0])) == "kept"
    assert [g[0].uid for g in asm.evict(lambda g: g[0].uid in "ac")] == ["a", "c"]
    assert [g[0].uid for g in asm.evict(lambda g: True)] == ["b", "d"]


def test_batch_assembler_validates_groups():
    asm = BatchAssembler(1)
    with pytest.raises(ValueError):
        asm.add([])
    with pytest.raises(ValueError):
        asm.add(make_group("a", [0.0]) + make_group("b", [1.0]))
    unscored = make_group("a", [0.0, 1.0])
    unscored[1].reward = None
    with pytest.raises(ValueError, match="unscored"):
        asm.add(unscored)
    for bad in (0, -1, 1.0):
        with pytest.raises(ValueError):
            BatchAssembler(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BatchAssembler(2, -0.1)
    assert (asm.kept, asm.dropped) == (0, 0)
