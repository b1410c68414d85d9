import asyncio
import time

import pytest

from miles_async.backends.packing import collate, pack_micro_batches
from miles_async.ray.eval_dispatcher import EvalDispatcher, EvalsFailed
from miles_async.utils.async_utils import WaitTimeout, race
from miles_async.utils.checkpoint import atomic_write_bytes, iteration_dir, latest_checkpointed_iteration, mark_complete
from miles_async.utils.misc import should_run_periodic_action


def test_periodic_action():
    hits = [r for r in range(10) if should_run_periodic_action(r, 3, None, 10)]
    assert hits == [2, 5, 8, 9]
    assert [r for r in range(10) if should_run_periodic_action(r, 100, 4, 10)] == [3, 7, 9]
    assert not any(should_run_periodic_action(r, None, 4, 10) for r in range(10))


def test_pack_respects_budget_and_order():
    lengths = [5, 3, 8, 2, 2, 9, 1]
    batches = pack_micro_batches(lengths, max_tokens=10)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 10
    assert pack_micro_batches([50], 10) == [[0]]  # oversize sample alone


def test_collate_aligns_responses_and_positions():
    mb = collate([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [[1, 1], [1, 0, 1]], pad_id=0)
    assert mb.input_ids.tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert mb.position_ids[1, 2:].tolist() == [0, 1, 2, 3]
    assert mb.response_ids.tolist() == [[5, 6, 0], [7, 8, 9]]
    assert mb.response_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    # the logit at column P-1+t predicts response token t for every row
    p = 3
    for row in range(2):
        for t in range(3):
            if mb.response_mask[row, t] > 0:
                assert mb.input_ids[row, p + t] == mb.response_ids[row, t]


def test_pointer_only_moves_when_complete(tmp_path):
    assert latest_checkpointed_iteration(tmp_path) is None
    iteration_dir(tmp_path, 3).mkdir(parents=True)
    mark_complete(tmp_path, 3)
    # a crash while writing iteration 5: its folder exists but the pointer still says 3
    (iteration_dir(tmp_path, 5) / "actor").mkdir(parents=True)
    assert latest_checkpointed_iteration(tmp_path) == 3
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(ValueError, match="incomplete"):
        latest_checkpointed_iteration(tmp_path)


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_race_surfaces_a_failing_watched_task_quickly():
    async def main():
        async def producer():
            await asyncio.sleep(0.05)
            raise RuntimeError("producer died")

        watched = asyncio.ensure_future(producer())
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="producer died"):
            await race(asyncio.sleep(30), [watched], timeout=60, what="buffer")
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5


def test_race_times_out_with_a_message():
    with pytest.raises(WaitTimeout, match="waiting for the thing"):
        asyncio.run(race(asyncio.sleep(10), [], timeout=0.05, what="the thing"))


def test_eval_dispatcher_bounds_in_flight_and_reports_every_failure():
    async def main(allowed):
        running, peak, results = 0, 0, {}

        async def run_eval(step):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            try:
                await asyncio.sleep(30 if step == 3 else 0.02)
            finally:
                running -= 1
            if step == 2:
                raise RuntimeError("eval engine hiccup")
            return {"acc": step}

        d = EvalDispatcher(run_eval, results.__setitem__, max_in_flight=2, timeout=1, failures_allowed=allowed)
        for step in range(5):
            await d.dispatch(step)
        await d.drain()
        return peak, results, d

    peak, results, d = asyncio.run(main(allowed=1))
    assert peak == 2
    assert sorted(results) == [0, 1, 4]  # training went on past the failures
    summary = (
        "2 eval(s) failed (--eval-failures-allowed 1):\n"
        "  eval at rollout 2: RuntimeError: eval engine hiccup\n"
        "  eval at rollout 3: took longer than 1 s (--rollout-timeout)"
    )
    assert d.summary() == summary
    with pytest.raises(EvalsFailed) as failed:
        d.check()
    assert str(failed.value) == summary
    _, _, tolerant = asyncio.run(main(allowed=2))
    tolerant.check()  # within the allowance: the run ends as a finished one
    assert len(tolerant.failures) == 2


def test_gather_fail_fast_raises_the_cause_and_cancels_the_rest():
    from miles_async.utils.async_utils import gather_fail_fast

    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def bad():
        await asyncio.sleep(0.01)
        raise KeyError("the real cause")

    async def nested():
        return await gather_fail_fast([slow(), bad()])

    with pytest.raises(KeyError, match="the real cause"):
        asyncio.run(asyncio.wait_for(gather_fail_fast([nested(), slow()]), 5))
    assert len(cancelled) == 2
    assert asyncio.run(gather_fail_fast([asyncio.sleep(0, result=i) for i in range(3)])) == [0, 1, 2]
