"""The Router's policy (least outstanding, retry on engine death, eviction, membership), with fake engine clients."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.inference.client import EngineError
from miles_async.inference.router import NoEngineError, Router


class FakeClient:
    """An engine: answers after ``gate`` opens, or fails like a dead engine when ``dead``."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.dead = False
        self.status: int | None = None
        self.gate: asyncio.Event | None = None
        self.served = 0
        self.closed = False

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        if self.gate is not None:
            await self.gate.wait()
        if self.dead:
            raise EngineError(self.url, "/generate", "ServerDisconnectedError: Server disconnected", self.status)
        self.served += 1
        return {"engine": self.url, "output_ids": list(input_ids)}

    async def close(self):
        self.closed = True


def make(urls, **kw) -> Router:
    return Router(urls, timeout=10, client_factory=FakeClient, **kw)


def test_least_outstanding_spreads_concurrent_requests():
    async def go():
        r = make(["a", "b", "c"])
        gate = asyncio.Event()
        for c in r.clients.values():
            c.gate = gate
        tasks = [asyncio.ensure_future(r.generate([1], {})) for _ in range(9)]
        await asyncio.sleep(0)
        assert r.outstanding == {"a": 3, "b": 3, "c": 3}
        gate.set()
        out = await asyncio.gather(*tasks)
        assert sorted(o["engine"] for o in out) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
        assert r.outstanding == {"a": 0, "b": 0, "c": 0}

    asyncio.run(go())


def test_without_retry_a_dead_engine_fails_the_request_with_a_hint():
    async def go():
        r = make(["a", "b"])
        r.clients["a"].dead = True
        with pytest.raises(EngineError, match="--use-fault-tolerance"):
            await r.generate([1], {})

    asyncio.run(go())


def test_with_retry_the_request_is_sent_again_to_another_engine():
    async def go():
        r = make(["a", "b"], retry=True, cooldown=30)
        r.clients["a"].dead = True
        out = await r.generate([5, 6], {})
        assert out == {"engine": "b", "output_ids": [5, 6]} and r.retries == 1
        # a is cooling down: the next request goes straight to b
        await r.generate([1], {})
        assert r.retries == 1 and r.clients["b"].served == 2

    asyncio.run(go())


def test_a_bad_request_is_not_retried():
    async def go():
        r = make(["a", "b"], retry=True)
        r.clients["a"].dead, r.clients["a"].status = True, 400
        r.clients["b"].dead, r.clients["b"].status = True, 400
        with pytest.raises(EngineError):
            await r.generate([1], {})
        assert r.retries == 0

    asyncio.run(go())


def test_requests_on_an_engine_taken_out_are_cancelled_and_retried():
    """A hung engine: its requests never answer; the controller takes it out and they move on."""

    async def go():
        r = make(["a", "b"], retry=True)
        r.clients["a"].gate = asyncio.Event()  # never opens
        task = asyncio.ensure_future(r.generate([1], {}))
        await asyncio.sleep(0)
        assert r.outstanding["a"] == 1
        hung = r.clients["a"]
        await r.set_engines(["b"])
        out = await task
        assert out["engine"] == "b" and hung.closed and "a" not in r.outstanding

    asyncio.run(go())


def test_with_no_engine_requests_wait_for_one_to_come_back_at_a_new_url():
    async def go():
        r = make(["a"], retry=True, cooldown=0.01)
        await r.set_engines([])
        task = asyncio.ensure_future(r.generate([1], {}))
        await asyncio.sleep(0.05)
        assert not task.done()
        await r.set_engines(["a2"])
        assert (await task)["engine"] == "a2"

    asyncio.run(go())


def test_fatal_fails_waiting_and_new_requests_with_its_message():
    async def go():
        r = make(["a"], retry=True, cooldown=0.01)
        await r.set_engines([])
        task = asyncio.ensure_future(r.generate([1], {}))
        await asyncio.sleep(0.02)
        await r.set_engines([], fatal="no inference engine is left serving: engine 0 gave up")
        with pytest.raises(NoEngineError, match="engine 0 gave up"):
            await task
        with pytest.raises(NoEngineError):
            await r.generate([1], {})

    asyncio.run(go())


def test_retries_are_bounded():
    async def go():
        r = make(["a", "b"], retry=True, cooldown=0.0, max_attempts=4)
        for c in r.clients.values():
            c.dead = True
        with pytest.raises(NoEngineError, match="4 engines in a row"):
            await r.generate([1], {})
        assert r.retries == 4

    asyncio.run(go())


def test_outer_cancellation_is_not_mistaken_for_an_eviction():
    async def go():
        r = make(["a", "b"], retry=True)
        r.clients["a"].gate = asyncio.Event()
        task = asyncio.ensure_future(r.generate([1], {}))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.outstanding == {"a": 0, "b": 0} and r.retries == 0

    asyncio.run(go())


def test_a_router_started_before_its_engines_takes_them_from_set_engines():
    """The rollout executor starts while the engines boot (Run._start_rollout); the controller's attach then gives
    its router the engines. Before that a request without retry fails naming why, instead of picking from nothing."""

    async def go():
        r = make([])
        with pytest.raises(NoEngineError, match="no engine yet"):
            await r.generate([1], {})
        await r.set_engines(["a", "b"])
        assert r.max_attempts == 4  # from the engines it has now, not the none it started with
        out = await asyncio.gather(*[r.generate([1], {}) for _ in range(4)])
        assert sorted(o["engine"] for o in out) == ["a", "a", "b", "b"]

    asyncio.run(go())
