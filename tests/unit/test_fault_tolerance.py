"""The engine fault-tolerance policy, driven by a fake clock and fake I/O (no sleeping, no processes)."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.inference.fault_tolerance import (
    AllEnginesFailed,
    EngineState,
    EngineSupervisor,
    FaultTolerancePolicy,
    Probe,
)


class FakeWorld:
    """Engines whose probe answers and restart outcomes the test sets; a clock it advances."""

    def __init__(self, n: int, policy: FaultTolerancePolicy | None = None):
        self.now = 100.0
        self.probe_result = {i: Probe.OK for i in range(n)}
        self.restart_fails: dict[int, int] = {}  # engine -> how many next restarts fail
        self.restarted: list[tuple[int, float]] = []
        self.changes: list[list[int]] = []
        self.sup = EngineSupervisor(
            n,
            policy or FaultTolerancePolicy(),
            clock=lambda: self.now,
            probe=self.probe,
            restart=self.restart,
            on_change=self.on_change,
            describe=lambda i: f"log of engine {i}",
        )

    async def probe(self, i: int):
        return self.probe_result[i], f"probe {self.probe_result[i].value}"

    async def restart(self, i: int) -> None:
        self.restarted.append((i, self.now))
        if self.restart_fails.get(i, 0) > 0:
            self.restart_fails[i] -= 1
            raise RuntimeError(f"engine {i} did not come up")
        self.probe_result[i] = Probe.OK

    async def on_change(self, serving: list[int]) -> None:
        self.changes.append(serving)

    def tick(self) -> None:
        async def go():
            await self.sup.tick()
            await self.sup.wait_recoveries()

        asyncio.run(go())


def test_healthy_engines_stay_serving_and_nothing_is_published():
    w = FakeWorld(2)
    for _ in range(3):
        w.tick()
    assert w.sup.serving() == [0, 1] and w.changes == [] and w.restarted == []


def test_a_dead_process_is_quarantined_and_restarted_in_the_same_tick():
    w = FakeWorld(2)
    w.probe_result[1] = Probe.DEAD
    w.tick()
    # quarantined (serving [0]) then restarted and back (serving [0, 1]), all within one interval
    assert w.changes == [[0], [0, 1]]
    assert w.restarted == [(1, 100.0)]
    assert w.sup.metrics()["engine/restarts"] == 1 and w.sup.metrics()["engine/serving"] == 2


def test_an_unresponsive_engine_needs_consecutive_failures():
    w = FakeWorld(2, FaultTolerancePolicy(failure_threshold=3))
    w.probe_result[0] = Probe.FAILED
    w.tick()
    w.tick()
    assert w.sup.state(0) == EngineState.SUSPECT and w.sup.serving() == [0, 1] and w.restarted == []
    w.probe_result[0] = Probe.OK  # a success clears the count
    w.tick()
    assert w.sup.state(0) == EngineState.HEALTHY
    w.probe_result[0] = Probe.FAILED
    w.tick()
    w.tick()
    assert w.restarted == []
    w.tick()
    assert w.restarted == [(0, 100.0)] and w.sup.state(0) == EngineState.HEALTHY


def test_failed_restarts_back_off_exponentially_up_to_the_cap_then_give_up():
    policy = FaultTolerancePolicy(failure_threshold=1, max_restarts=5, backoff_base=2.0, backoff_cap=5.0)
    w = FakeWorld(2, policy)
    w.probe_result[1] = Probe.DEAD
    w.restart_fails[1] = 10
    times = []
    for _ in range(40):
        w.tick()
        w.now += 0.5
        if w.restarted and (not times or w.restarted[-1][1] != times[-1]):
            times.append(w.restarted[-1][1])
    delays = [b - a for a, b in zip(times, times[1:])]
    # immediate first restart; then 2, 4, then capped at 5 (observed on the 0.5 s tick grid)
    assert delays == [2.0, 4.0, 5.0, 5.0]
    assert len(w.restarted) == 5
    assert w.sup.state(1) == EngineState.GAVE_UP
    assert w.sup.serving() == [0]  # the run goes on with the other engine
    assert w.sup.metrics()["engine/gave_up"] == 1 and w.sup.metrics()["engine/restarts"] == 0


def test_restart_count_is_over_the_run_so_a_flapping_engine_is_given_up():
    w = FakeWorld(2, FaultTolerancePolicy(max_restarts=2, backoff_base=1.0))
    for _ in range(3):
        w.probe_result[1] = Probe.DEAD
        w.tick()  # quarantined (restarted now if no backoff is due)
        w.now += 10
        w.tick()  # the backoff has elapsed: restarted
    assert [i for i, _ in w.restarted] == [1, 1]
    assert w.sup.state(1) == EngineState.GAVE_UP


def test_no_restarts_allowed_gives_up_at_once():
    w = FakeWorld(2, FaultTolerancePolicy(max_restarts=0))
    w.probe_result[0] = Probe.DEAD
    w.tick()
    assert w.restarted == [] and w.sup.state(0) == EngineState.GAVE_UP and w.changes == [[1]]


def test_when_no_engine_is_left_serving_the_run_fails_naming_each_engine():
    w = FakeWorld(2, FaultTolerancePolicy(max_restarts=1))
    w.probe_result[0] = Probe.DEAD
    w.probe_result[1] = Probe.DEAD
    with pytest.raises(AllEnginesFailed) as err:
        w.tick()
    text = str(err.value)
    assert "engine 0" in text and "engine 1" in text and "log of engine 1" in text and "probe dead" in text
    assert w.restarted == []  # nothing to copy the weights from: no restart was attempted
    with pytest.raises(AllEnginesFailed):  # and every later tick says so too
        w.tick()


def test_a_probe_that_raises_counts_as_a_failure():
    w = FakeWorld(1, FaultTolerancePolicy(failure_threshold=2))

    async def broken(i):
        raise OSError("connection refused")

    w.sup._probe = broken
    w.tick()
    assert w.sup.state(0) == EngineState.SUSPECT
    assert "connection refused" in w.sup.engines[0].last_error


def test_restarts_run_in_the_background_while_other_engines_are_probed():
    """A restart that takes long must not delay the detection of a second failure."""
    released = asyncio.Event()
    probes: list[int] = []
    changes: list[list[int]] = []
    state = {0: Probe.OK, 1: Probe.DEAD, 2: Probe.OK}

    async def probe(i):
        probes.append(i)
        return state[i], ""

    async def slow_restart(i):
        await released.wait()

    async def on_change(serving):
        changes.append(serving)

    async def go():
        sup = EngineSupervisor(
            3,
            FaultTolerancePolicy(failure_threshold=1),
            clock=lambda: 0.0,
            probe=probe,
            restart=slow_restart,
            on_change=on_change,
        )
        await sup.tick()  # engine 1 dies, its restart starts and hangs
        assert sup.state(1) == EngineState.RESTARTING
        state[2] = Probe.FAILED
        await sup.tick()  # engine 2 is still probed and quarantined meanwhile
        assert sup.state(2) in (EngineState.RESTARTING, EngineState.QUARANTINED)
        assert changes[-1] == [0]
        released.set()
        await sup.wait_recoveries()
        assert sup.serving() == [0, 1, 2] and changes[-1] == [0, 1, 2]

    asyncio.run(go())


def test_flags_build_the_fault_tolerance_config(tmp_path):
    from miles_async.arguments import ConfigError, parse_args
    from tests.flag_helpers import minimal_flags

    base = [*minimal_flags(tmp_path, n_prompts=8), "--num-rollout", "2"]
    assert parse_args(base).engine.fault_tolerance is None  # off by default: a dead engine fails the run
    cfg = parse_args(
        base
        + [
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "2",
            "--rollout-health-check-timeout",
            "1",
            "--max-engine-restarts",
            "5",
            "--check-weight-update-equal",
        ]
    )
    ft = cfg.engine.fault_tolerance
    assert (ft.health_check_interval, ft.health_check_timeout, ft.max_engine_restarts) == (2, 1, 5)
    assert cfg.engine.check_weight_update_equal and cfg.engine.router == "builtin"
    for extra, fragment in [
        (["--rollout-health-check-interval", "0"], "--rollout-health-check-interval"),
        (["--max-engine-restarts", "-1"], "--max-engine-restarts"),
        (["--rollout-router", "sglang"], "sglang_router"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            parse_args(base + ["--use-fault-tolerance", *extra])
