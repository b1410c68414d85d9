"""Controlling a running embedded server: pause (abort, in place), continue, abort by rid or all, flush the cache,
the running-request cap, client timeouts, SIGTERM, a dead decode thread, the engine class it runs, and a bad
--listen-fd. (--port 0: the package's server, conftest.py; --listen-fd: every other ServerProc.)"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_async.inference.client import EngineError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from tests.integration.embedded.helpers import GREEDY, KEY, LONG, ServerProc, make_prompts, run, wait_running


def test_pause_abort_then_continue(server: ServerProc) -> None:
    prompts = make_prompts(4)

    async def body(c: EmbeddedEngineClient) -> tuple[list[dict], bool, dict]:
        tasks = [asyncio.create_task(c.generate(p, LONG)) for p in prompts]
        await wait_running(c, len(prompts))
        await c.pause("abort")
        aborted = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        # Accepted while paused, but must wait for continue_generation.
        late = asyncio.create_task(c.generate(prompts[0], {"temperature": 0.0, "max_new_tokens": 5}))
        await asyncio.sleep(0.3)
        waited = not late.done()
        await c.resume()
        return aborted, waited, await asyncio.wait_for(late, 10)

    aborted, waited, late = run(body, server.url)
    for res in aborted:
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(res["output_ids"]) < 200
        assert len(meta["output_token_logprobs"]) == len(res["output_ids"])
    assert waited, "a request sent while paused finished before continue_generation"
    assert late["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert len(late["output_ids"]) >= 1


def test_abort_request_by_rid(server: ServerProc) -> None:
    async def body(c: EmbeddedEngineClient) -> tuple[dict, dict, dict]:
        task = asyncio.create_task(c.generate([1, 30, 31], LONG, rid="victim"))
        other = asyncio.create_task(c.generate([1, 32, 33], {**LONG, "max_new_tokens": 60, "min_new_tokens": 60}))
        await wait_running(c, 2)
        await asyncio.sleep(0.05)
        resp = await c.abort(rid="victim")
        return await asyncio.wait_for(task, 10), await asyncio.wait_for(other, 20), resp

    victim, other, resp = run(body, server.url)
    assert resp["num_aborted"] == 1
    assert victim["meta_info"]["id"] == "victim"
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(victim["output_ids"]) < 200
    # Aborting one row must not disturb its batch neighbour.
    assert other["meta_info"]["finish_reason"]["type"] == "length"
    assert len(other["output_ids"]) == 60


def test_flush_cache_mid_generation_keeps_greedy_output(server: ServerProc) -> None:
    """Flushing drops the KV cache; running rows are re-prefilled and must continue identically."""
    params = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}
    prompt = [1, 44, 45, 46, 47]

    async def body(c: EmbeddedEngineClient) -> tuple[dict, dict, dict]:
        plain = await c.generate(prompt, params)
        before = await c.load()
        task = asyncio.create_task(c.generate(prompt, params))
        await wait_running(c, 1)
        await asyncio.sleep(0.1)
        await c.flush_cache()
        await c.pause("in_place")
        await c.flush_cache()  # must be safe while paused, too
        await c.resume()
        flushed = await asyncio.wait_for(task, 20)
        return plain, flushed, {"before": before, "after": await c.load()}

    plain, flushed, loads = run(body, server.url)
    assert flushed["output_ids"] == plain["output_ids"]
    # The flushes really forced extra prefills (1 for the request, 1-2 re-prefills).
    assert loads["after"]["prefill_batches"] - loads["before"]["prefill_batches"] >= 2


def test_max_running_requests_and_abort_all(server: ServerProc) -> None:
    prompts = make_prompts(20)  # the server runs with --max-running-requests 16

    async def body(c: EmbeddedEngineClient) -> tuple[dict, list[dict], dict]:
        tasks = [asyncio.create_task(c.generate(p, LONG)) for p in prompts]
        load = await wait_running(c, 16)
        await asyncio.sleep(0.05)
        load = await c.load()
        resp = await c.abort(abort_all=True)
        return load, await asyncio.wait_for(asyncio.gather(*tasks), 10), resp

    load, results, resp = run(body, server.url)
    assert load["num_running_reqs"] == 16
    assert load["num_waiting_reqs"] == 4
    assert resp["num_aborted"] == 20
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    started = [r for r in results if r["output_ids"]]
    assert len(started) == 16  # the 4 queued ones never got a slot


def test_client_timeout_raises_and_frees_slot(server: ServerProc) -> None:
    async def body(c: EmbeddedEngineClient) -> tuple[EngineError | None, dict]:
        err = None
        try:
            await c.generate([1, 40, 41], LONG, timeout=0.2)
        except EngineError as exc:
            err = exc
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = await c.load()
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.02)
        return err, load

    err, load = run(body, server.url)
    assert err is not None and "timed out" in str(err) and "/generate" in str(err)
    # The server noticed the disconnect and dropped the request well before 200 tokens.
    assert load["num_running_reqs"] == 0


def test_sigterm_exits_promptly(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    srv = ServerProc(model_dirs["base"], tmp_path / "sigterm.log")
    try:
        srv.wait_healthy()

        async def body(c: EmbeddedEngineClient) -> Any:
            task = asyncio.create_task(c.generate([1, 3, 4], LONG))
            await wait_running(c, 1)
            srv.proc.send_signal(signal.SIGTERM)
            try:
                return await asyncio.wait_for(task, 10)
            except EngineError as exc:
                return exc

        t0 = time.monotonic()
        inflight = run(body, srv.url)
        code = srv.proc.wait(timeout=8)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    assert elapsed < 8
    assert code == 0, srv.log_tail()
    # The in-flight request got an answer (its partial output) rather than hanging.
    assert isinstance(inflight, dict), inflight
    assert inflight["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_bad_listen_fd_is_refused_naming_the_flag(model_dirs: dict[str, Path]) -> None:
    from miles_async.inference.embedded.server import inherited_socket

    with open(model_dirs["base"] / "config.json") as not_a_socket:
        with pytest.raises(SystemExit, match=f"--listen-fd {not_a_socket.fileno()}: not a socket"):
            inherited_socket(not_a_socket.fileno())


def test_dead_decode_thread_fails_requests(model_dirs: dict[str, Path]) -> None:
    """In-process: if the decode thread dies, pending and later requests get 500, health 500."""
    from aiohttp.test_utils import TestServer

    from miles_async.inference.embedded.engine import Engine
    from miles_async.inference.embedded.server import build_app

    engine = Engine(str(model_dirs["base"]), dtype=torch.float32)

    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated kernel failure")

    engine.model.forward = broken_forward
    engine.start()

    async def main() -> tuple[list[Any], bool, Any]:
        srv = TestServer(build_app(engine, KEY.reveal()), host="127.0.0.1")
        await srv.start_server()
        url = str(srv.make_url("")).rstrip("/")
        try:
            async with EmbeddedEngineClient(url, timeout=10, api_key=KEY) as c:
                first = await asyncio.gather(*(c.generate([1, 2, 3], GREEDY) for _ in range(3)), return_exceptions=True)
                later = await asyncio.gather(c.generate([1, 2, 3], GREEDY), return_exceptions=True)
                return first + later, await c.health(), await asyncio.gather(c.pause(), return_exceptions=True)
        finally:
            await srv.close()

    results, healthy, pause = asyncio.run(main())
    assert not healthy
    for r in results + pause:
        assert isinstance(r, EngineError) and r.status == 500, r
        assert "simulated kernel failure" in str(r)


def test_the_engine_class_is_a_plugin_point(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``$MILES_ASYNC_ENGINE_CLASS`` names the ``Engine`` subclass the server runs; anything else is refused naming
    the variable. The benchmarks' double makes every decode step cost what they set."""
    from benchmarks.engine_doubles import STEP_SECONDS_ENV, FixedStepCost, fixed_step_cost_env
    from miles_async.inference.embedded.engine import Engine
    from miles_async.inference.embedded.records import SamplingParams
    from miles_async.inference.embedded.server import ENGINE_CLASS_ENV, engine_class
    from miles_async.utils.plugins import PluginError

    assert engine_class(None) is Engine
    env = fixed_step_cost_env(0.1)
    assert engine_class(env[ENGINE_CLASS_ENV]) is FixedStepCost
    with pytest.raises(PluginError, match=r"\$MILES_ASYNC_ENGINE_CLASS: .*sample_tokens.* is not a subclass"):
        engine_class("miles_async.inference.embedded.sampling:sample_tokens")
    with pytest.raises(PluginError, match=r"\$MILES_ASYNC_ENGINE_CLASS: cannot import module 'no_such_module'"):
        engine_class("no_such_module:Engine")

    monkeypatch.delenv(STEP_SECONDS_ENV, raising=False)
    with pytest.raises(ValueError, match=r"\$MILES_ASYNC_ENGINE_STEP_SECONDS"):
        FixedStepCost(str(model_dirs["base"]), dtype=torch.float32)
    monkeypatch.setenv(STEP_SECONDS_ENV, env[STEP_SECONDS_ENV])
    engine = FixedStepCost(str(model_dirs["base"]), dtype=torch.float32)
    engine.start()
    try:
        t0 = time.monotonic()
        res = engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=11, ignore_eos=True)).result(30)
        elapsed = time.monotonic() - t0
    finally:
        engine.shutdown()
    # The first token comes from the prefill, each of the other ten from a decode step of at least 100 ms
    # (a step of this model takes a few milliseconds).
    assert len(res.output_ids) == 11 and engine.stats["decode_steps"] == 10
    assert elapsed >= 10 * 0.1
