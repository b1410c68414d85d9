"""Staleness manager, batch assembly and consumed-uid tracking for fully-async training.

The simulations are discrete-event models of the fully-async loop (a producer that submits
whenever there is capacity, groups finishing after random durations, a trainer consuming one
batch per step); they drive the real classes, so the properties below are about the code the
producer uses, not about a model of it.
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from miles_async.rollout.filters import BatchAssembler, zero_variance_groups
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.rollout.staleness import StalenessManager, StalenessStats, staleness_of
from miles_async.rollout.uid_tracker import ConsumedUids

FAST = settings(max_examples=100, deadline=None)


def make_group(uid: str, rewards: list[float], version: int = 0, n_tokens: int = 3) -> list[Sample]:
    return [Sample(uid=uid, group_index=0, index=i, prompt="p", response_tokens=[1] * n_tokens,
                   weight_versions=[version] * n_tokens, reward=r, status=SampleStatus.COMPLETED,
                   metadata={"submitted_at_step": version})
            for i, r in enumerate(rewards)]


def counts(m: StalenessManager) -> tuple[int, ...]:
    return (m.current_step, m.submitted, m.accepted, m.running, m.filtered, m.rejected)


# ---------------------------------------------------------------------------------------------
# StalenessManager: plain unit tests
# ---------------------------------------------------------------------------------------------

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
    m.check_invariants()


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
    for call in (m.on_accepted, m.on_rejected, m.on_filtered):
        with pytest.raises(RuntimeError):
            call()
    assert counts(m) == before
    m.try_submit()
    m.on_accepted()
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
    m.check_invariants()


def test_rejected_groups_keep_the_invariant_and_free_their_slot():
    m = StalenessManager(1, 1, 0)
    assert m.try_submit() and not m.try_submit()
    m.on_rejected()
    assert m.submitted == 1 and m.rejected == 1 and m.capacity() == 1
    m.check_invariants()


def test_check_invariants_names_the_counts():
    m = StalenessManager(2, 2, 0)
    m.try_submit()
    m.running = 0  # simulate a lost update
    with pytest.raises(AssertionError, match=r"submitted=1 accepted=0 running=0"):
        m.check_invariants()


def test_state_dict_drops_in_flight_work_and_survives_json():
    m = StalenessManager(8, 2, 1)
    for _ in range(4):
        m.try_submit()
    for _ in range(4):
        m.on_accepted()
    m.on_step(1)
    m.try_submit()
    m.on_accepted()
    m.on_filtered()
    m.try_submit()
    m.try_submit()
    m.on_rejected()  # one running, two pending, one filtered, one rejected
    state = json.loads(json.dumps(m.state_dict()))
    r = StalenessManager(3, 2, 0)  # concurrency and staleness may change on resume
    r.load_state_dict(state)
    r.check_invariants()
    assert (r.current_step, r.accepted, r.running, r.filtered, r.rejected, r.submitted) == (1, 2, 0, 1, 1, 4)
    assert r.capacity() == 2
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(3, 4, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        StalenessManager(3, 2, 0).load_state_dict({"current_step": 1})
    with pytest.raises(ValueError):
        StalenessManager(3, 2, 0).load_state_dict(state | {"accepted": 3})


def test_resume_at_step_without_a_saved_state():
    m = StalenessManager(4, 2, 1)
    with pytest.raises(ValueError):
        m.on_step(3)  # a fresh manager never saw the 6 groups of 3 steps
    m.resume_at_step(3)
    m.on_step(3)
    assert (m.current_step, m.accepted, m.pending, m.capacity()) == (3, 6, 0, 4)
    m.check_invariants()
    with pytest.raises(RuntimeError):
        m.resume_at_step(4)
    with pytest.raises(ValueError):
        StalenessManager(4, 2, 1).resume_at_step(-1)


def test_staleness_of_and_stats():
    assert staleness_of(5, [5, 4, 3]) == 2
    assert staleness_of(5, [2, 5], loss_mask=[0, 1]) == 0  # tool output is not trained
    assert staleness_of(5, []) == 0
    with pytest.raises(ValueError):
        staleness_of(3, [4])  # newer than the trained policy: counters disagree
    with pytest.raises(ValueError):
        staleness_of(3, [1], loss_mask=[1, 1])
    with pytest.raises(ValueError):
        staleness_of(3, [-1])
    samples = make_group("a", [0.0, 1.0], version=3) + make_group("b", [0.0], version=5)
    samples.append(Sample(uid="c", group_index=0, index=0, prompt="p"))  # aborted, nothing to train
    stats = StalenessStats.from_samples(5, samples, max_staleness_steps=1)
    assert (stats.count, stats.min, stats.max, stats.over_budget) == (3, 0, 2, 2)
    assert stats.mean == pytest.approx(4 / 3)
    assert StalenessStats.from_samples(5, []).count == 0
    assert set(stats.as_metrics()) >= {"async/staleness_max", "async/staleness_mean"}


def test_capacity_alone_is_not_a_per_group_bound():
    # A straggler keeps running while fast groups fill steps in front of it; only the consumer's
    # freshness check (is_fresh / min_trainable_step) can keep it out of training.
    m = StalenessManager(max_concurrent_groups=2, batch_size=1, max_staleness_steps=1)
    assert m.try_submit() and m.try_submit()  # straggler and a fast group, both at step 0
    straggler_step = 0
    for step in range(1, 5):
        m.on_accepted()  # the fast group finishes and is trained
        m.on_step(step)
        assert m.try_submit()
    assert not m.is_fresh(straggler_step) and m.min_trainable_step() == 3
    m.check_invariants()


# ---------------------------------------------------------------------------------------------
# StalenessManager: any interleaving of events
# ---------------------------------------------------------------------------------------------

class StalenessMachine(RuleBasedStateMachine):
    @initialize(conc=st.integers(1, 8), batch=st.integers(1, 5), stale=st.integers(0, 3))
    def setup(self, conc, batch, stale):
        self.m = StalenessManager(conc, batch, stale)
        self.model = dict(step=0, submitted=0, accepted=0, running=0, filtered=0, rejected=0)

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

    @precondition(lambda self: self.m.running > 0)
    @rule()
    def reject(self):
        self.m.on_rejected()
        self.model["running"] -= 1
        self.model["rejected"] += 1

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

    @rule()
    def checkpoint_round_trip(self):
        m = self.m
        r = StalenessManager(m.max_concurrent_groups, m.batch_size, m.max_staleness_steps)
        r.load_state_dict(json.loads(json.dumps(m.state_dict())))
        r.check_invariants()
        assert (r.current_step, r.accepted, r.running, r.filtered, r.rejected) == (
            m.current_step, m.trained, 0, m.filtered, m.rejected)
        assert r.capacity() == min(m.max_concurrent_groups, (m.max_staleness_steps + 1) * m.batch_size)

    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()
        assert (m.current_step, m.submitted, m.accepted, m.running, m.filtered, m.rejected) == tuple(
            self.model.values())
        assert min(counts(m)) >= 0
        assert 0 <= m.capacity() <= m.max_concurrent_groups - m.running
        assert m.capacity() == max(0, min(m.max_concurrent_groups - m.running,
                                          (m.max_staleness_steps + m.current_step + 1) * m.batch_size
                                          - (m.accepted + m.running)))


TestStalenessMachine = StalenessMachine.TestCase
TestStalenessMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# ---------------------------------------------------------------------------------------------
# Steady-state simulation of the fully-async loop
# ---------------------------------------------------------------------------------------------

@dataclass
class SimResult:
    trained: list[tuple[int, int]] = field(default_factory=list)  # (trained_step, submitted_step)
    submitted_steps: list[tuple[int, int]] = field(default_factory=list)  # (current_step, submitted_step)
    running_while_training: list[int] = field(default_factory=list)
    stale_dropped: int = 0
    aborted: int = 0
    zero_variance_dropped: int = 0
    steps: int = 0


def simulate(rng: random.Random, *, conc: int, batch: int, stale: int, n_steps: int, filter_p: float,
             duration, train_time: float, evict_stale: bool = True, abort_doomed: bool = False,
             max_events: int = 200_000) -> SimResult:
    m = StalenessManager(conc, batch, stale)
    asm = BatchAssembler(batch, tol=0.0)
    res = SimResult()
    events: list[tuple[float, int, str, int]] = []
    running: dict[int, int] = {}  # group id -> submitted step
    seq = 0
    now = 0.0
    training = False
    in_training: list[list[Sample]] = []

    def push(t: float, kind: str, gid: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, gid))

    def act() -> None:
        nonlocal training
        while m.try_submit():
            gid = seq
            running[gid] = m.current_step
            res.submitted_steps.append((m.current_step, m.current_step))
            push(now + duration(rng), "finish", gid)
        if not training and asm.ready():
            in_training[:] = asm.take()
            training = True
            res.running_while_training.append(m.running)
            push(now + train_time, "trained", -1)

    act()
    for _ in range(max_events):
        if res.steps >= n_steps:
            return res
        assert events, f"deadlock at step {m.current_step}: {counts(m)}"
        now, _, kind, gid = heapq.heappop(events)
        if kind == "finish":
            if gid in running:  # not aborted
                submitted = running.pop(gid)
                m.on_accepted()
                if evict_stale and not m.is_fresh(submitted):
                    m.on_filtered()
                    res.stale_dropped += 1
                else:
                    rewards = [1.0, 1.0] if rng.random() < filter_p else [0.0, 1.0]
                    if asm.add(make_group(f"g{gid}", rewards, version=submitted)) == "dropped":
                        m.on_filtered()
                        res.zero_variance_dropped += 1
        else:
            for g in in_training:
                res.trained.append((m.current_step, g[0].metadata["submitted_at_step"]))
            stats = StalenessStats.from_samples(m.current_step, [s for g in in_training for s in g],
                                                max_staleness_steps=stale)
            assert stats.count == 2 * batch and stats.max == max(m.current_step - v for v in (
                g[0].metadata["submitted_at_step"] for g in in_training))
            if evict_stale:
                assert stats.over_budget == 0
            training = False
            res.steps += 1
            m.on_step(m.current_step + 1)
            if evict_stale:
                for _g in asm.evict(lambda g: not m.is_fresh(g[0].metadata["submitted_at_step"])):
                    m.on_filtered()
                    res.stale_dropped += 1
            if abort_doomed:
                for doomed in [g for g, k in running.items() if k < m.min_trainable_step()]:
                    del running[doomed]
                    m.on_rejected()
                    res.aborted += 1
        m.check_invariants()
        assert m.running == len(running) and m.pending == asm.num_ready() + (batch if training else 0)
        assert m.capacity() <= conc - m.running
        act()
        m.check_invariants()
    raise AssertionError(f"no progress after {max_events} events: {counts(m)}")


sim_params = dict(conc=st.integers(1, 12), batch=st.integers(1, 4), stale=st.integers(0, 3),
                  filter_p=st.sampled_from([0.0, 0.3, 0.7]), seed=st.integers(0, 2**32 - 1),
                  train_time=st.sampled_from([0.1, 1.0, 5.0]), abort=st.booleans())


@FAST
@given(**sim_params)
def test_random_durations_never_train_a_group_beyond_the_staleness_budget(conc, batch, stale, filter_p, seed,
                                                                           train_time, abort):
    res = simulate(random.Random(seed), conc=conc, batch=batch, stale=stale, n_steps=8, filter_p=filter_p,
                   duration=lambda r: r.expovariate(1.0) * r.choice([0.2, 1.0, 10.0]), train_time=train_time,
                   abort_doomed=abort)
    assert len(res.trained) == 8 * batch
    assert all(trained - submitted <= stale for trained, submitted in res.trained)


@FAST
@given(**sim_params)
def test_in_order_completion_needs_no_eviction(conc, batch, stale, filter_p, seed, train_time, abort):
    # Groups finishing in submission order: the capacity rule alone bounds staleness.
    res = simulate(random.Random(seed), conc=conc, batch=batch, stale=stale, n_steps=8, filter_p=filter_p,
                   duration=lambda r: 1.0, train_time=train_time, evict_stale=False)
    assert all(trained - submitted <= stale for trained, submitted in res.trained)
    assert res.stale_dropped == 0


@FAST
@given(conc=st.integers(1, 12), batch=st.integers(1, 4), filter_p=st.sampled_from([0.0, 0.5]),
       seed=st.integers(0, 2**32 - 1), train_time=st.sampled_from([0.1, 5.0]))
def test_zero_staleness_is_strictly_synchronous(conc, batch, filter_p, seed, train_time):
    res = simulate(random.Random(seed), conc=conc, batch=batch, stale=0, n_steps=6, filter_p=filter_p,
                   duration=lambda r: r.expovariate(1.0) * r.choice([0.2, 10.0]), train_time=train_time,
                   evict_stale=False)
    # Every trained group was generated for the very step that trains it, nothing generates
    # while the trainer works, and nothing ever had to be thrown away for staleness.
    assert all(trained == submitted for trained, submitted in res.trained)
    assert res.running_while_training == [0] * len(res.running_while_training)
    assert res.stale_dropped == 0


@settings(max_examples=40, deadline=None)
@given(conc=st.integers(1, 8), batch=st.integers(1, 4), stale=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_heavy_filtering_still_makes_progress(conc, batch, stale, seed):
    res = simulate(random.Random(seed), conc=conc, batch=batch, stale=stale, n_steps=5, filter_p=0.9,
                   duration=lambda r: r.uniform(0.1, 3.0), train_time=1.0)
    assert res.steps == 5 and len(res.trained) == 5 * batch
    assert res.zero_variance_dropped > 0


# ---------------------------------------------------------------------------------------------
# Finite epochs: flush at the end, checkpoint and resume
# ---------------------------------------------------------------------------------------------

def run_epoch(uids: list[str], zero_var: set[str], m: StalenessManager, asm: BatchAssembler,
              tracker: ConsumedUids, rng: random.Random, crash_after_step: int | None = None):
    """One epoch with random completion order; returns (trained uids, checkpoint or None, leftover)."""
    todo = [u for u in uids if not tracker.should_skip(u)]
    running: list[str] = []
    trained: list[str] = []
    while True:
        while todo and m.try_submit():
            running.append(todo.pop(0))
        if running and (not asm.ready() or rng.random() < 0.5):
            uid = running.pop(rng.randrange(len(running)))
            m.on_accepted()
            if asm.add(make_group(uid, [1.0, 1.0] if uid in zero_var else [0.0, 1.0])) == "dropped":
                m.on_filtered()
                tracker.mark_filtered([uid])
        elif asm.ready():
            batch_uids = [g[0].uid for g in asm.take()]
            tracker.mark_trained(batch_uids)
            trained += batch_uids
            m.on_step(m.current_step + 1)
            if m.current_step == crash_after_step:
                return trained, json.dumps({"staleness": m.state_dict(), "uids": tracker.state_dict()}), []
        else:
            leftover = asm.flush_partial()
            for g in leftover:
                m.on_filtered()
            tracker.mark_filtered([g[0].uid for g in leftover])
            assert m.running == 0 and m.pending == 0
            assert m.submitted == m.accepted + m.filtered + m.rejected
            return trained, None, [g[0].uid for g in leftover]
        m.check_invariants()


@FAST
@given(n=st.integers(1, 30), batch=st.integers(1, 4), stale=st.integers(0, 2), conc=st.integers(1, 6),
       zero_frac=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_epoch_end_flushes_a_partial_batch_instead_of_hanging(n, batch, stale, conc, zero_frac, seed):
    rng = random.Random(seed)
    uids = [f"u{i}" for i in range(n)]
    zero_var = {u for u in uids if rng.random() < zero_frac}
    m, tracker = StalenessManager(conc, batch, stale), ConsumedUids()
    asm = BatchAssembler(batch)
    trained, _, leftover = run_epoch(uids, zero_var, m, asm, tracker, rng)
    assert len(trained) % batch == 0 and len(trained) == m.current_step * batch
    assert len(leftover) < batch
    assert sorted(tracker.trained_uids() + tracker.filtered_uids()) == sorted(uids)
    assert asm.dropped == len(zero_var)
    tracker.new_epoch(1)
    assert not any(tracker.should_skip(u) for u in uids)


@FAST
@given(n=st.integers(4, 30), batch=st.integers(1, 3), stale=st.integers(0, 2), conc=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1), crash=st.integers(1, 3))
def test_resume_skips_consumed_uids(n, batch, stale, conc, seed, crash):
    rng = random.Random(seed)
    uids = [f"u{i}" for i in range(n)]
    zero_var = {u for u in uids if rng.random() < 0.3}
    m, tracker = StalenessManager(conc, batch, stale), ConsumedUids()
    first, ckpt, _ = run_epoch(uids, zero_var, m, BatchAssembler(batch), tracker, rng, crash_after_step=crash)
    if ckpt is None:
        return  # the epoch ended before the crash point
    state = json.loads(ckpt)
    m2, tracker2 = StalenessManager(conc, batch, stale), ConsumedUids()
    m2.load_state_dict(state["staleness"])
    tracker2.load_state_dict(state["uids"])
    assert m2.current_step == crash and tracker2.num_trained == crash * batch
    before = set(tracker2.trained_uids()) | set(tracker2.filtered_uids())
    second, _, _ = run_epoch(uids, zero_var, m2, BatchAssembler(batch), tracker2, rng)
    assert not before & set(second)  # nothing consumed before the checkpoint is trained again
    assert set(first) == set(state["uids"]["trained"])
    assert sorted(tracker2.trained_uids() + tracker2.filtered_uids()) == sorted(uids)


# ---------------------------------------------------------------------------------------------
# filters.py
# ---------------------------------------------------------------------------------------------

def test_zero_variance_groups():
    assert zero_variance_groups([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5 + 1e-9], [], [3.0]], tol=1e-6) == [
        True, False, True, True, True]
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
    assert (asm.kept, asm.dropped) == (3, 1)
    assert [g[0].uid for g in asm.flush_partial()] == ["d"]
    assert asm.flush_partial() == [] and asm.num_ready() == 0


def test_batch_assembler_without_filter_and_eviction():
    asm = BatchAssembler(3, None)
    for uid, version in (("a", 0), ("b", 2), ("c", 1), ("d", 3)):
        assert asm.add(make_group(uid, [1.0, 1.0], version=version)) == "kept"
    evicted = asm.evict(lambda g: g[0].metadata["submitted_at_step"] < 2)
    assert [g[0].uid for g in evicted] == ["a", "c"] and asm.evicted == 2
    assert [g[0].uid for g in asm.flush_partial()] == ["b", "d"]


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


# ---------------------------------------------------------------------------------------------
# uid_tracker.py
# ---------------------------------------------------------------------------------------------

def test_consumed_uids_rejects_duplicates_within_an_epoch():
    t = ConsumedUids()
    t.mark_trained(["a", "b"])
    t.mark_filtered(["c"])
    assert t.should_skip("a") and t.should_skip("c") and not t.should_skip("d")
    for call, uids in ((t.mark_trained, ["a"]), (t.mark_filtered, ["b"]), (t.mark_trained, ["c"]),
                       (t.mark_trained, ["d", "d"])):
        with pytest.raises(ValueError):
            call(uids)
    assert not t.should_skip("d")  # a rejected call records nothing
    assert (t.num_trained, t.num_filtered) == (2, 1)
    t.new_epoch(1)
    assert not t.should_skip("a")
    t.mark_trained(["a"])  # a new epoch may reuse every prompt
    for bad in (1, 0, -1):
        with pytest.raises(ValueError):
            t.new_epoch(bad)


def test_consumed_uids_state_round_trip():
    t = ConsumedUids(epoch=3)
    t.mark_trained(["x", "a"])
    t.mark_filtered(["m"])
    state = json.loads(json.dumps(t.state_dict()))
    assert state["trained"] == ["x", "a"]  # order kept, lists not sets
    r = ConsumedUids()
    r.load_state_dict(state)
    assert (r.epoch, r.trained_uids(), r.filtered_uids()) == (3, ["x", "a"], ["m"])
    assert r.should_skip("x") and r.should_skip("m")
    with pytest.raises(ValueError):
        ConsumedUids().load_state_dict(state | {"filtered": ["x"]})
    with pytest.raises(ValueError):
        ConsumedUids().load_state_dict({"epoch": 0, "trained": "abc", "filtered": []})
    with pytest.raises(ValueError):
        ConsumedUids().load_state_dict({"epoch": 0})
