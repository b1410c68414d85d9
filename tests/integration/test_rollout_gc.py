"""The rollout executor's garbage-collector policy, and the stand-in engines that measure it.

The executor holds every sample of a step in flight; with CPython's default thresholds those samples were
promoted to the oldest generation and set off full collections of the whole heap several times a step, a cost
per sample that grew with the number in flight (``benchmarks/scale.py``). These tests run the real executor,
in a process of its own, against real stand-in HTTP engines.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.http_engine_doubles import serve
from miles_async.inference.client import EngineClient, EngineError
from miles_async.rollout.gc_policy import ROLLOUT_GC_THRESHOLDS
from tests import ray_cluster
from tests.conftest import ROOT

IN_FLIGHT = 4096

# One rollout executor built as a run builds it, 3 steps of IN_FLIGHT samples all in flight at once against one
# stand-in engine: the collections of each generation during the last 2 steps, and the executor's GC state.
SCRIPT = textwrap.dedent(
    f"""
    import asyncio, gc, json, sys, tempfile
    from pathlib import Path
    import ray
    from benchmarks.common import tiny_setup
    from benchmarks.scale import _executor, stand_in_engines

    work = Path(tempfile.mkdtemp())
    model, data, _ = tiny_setup(work, n_train={IN_FLIGHT} // 8)
    ray.init(address=sys.argv[1], log_to_driver=False)  # the session's cluster (tests/ray_cluster.py)
    collections = {{0: 0, 1: 0, 2: 0}}
    gc.callbacks.append(lambda phase, info: phase == "stop" and collections.__setitem__(
        info["generation"], collections[info["generation"]] + 1))

    async def go():
        ex = _executor(urls, model, data, {IN_FLIGHT})
        state = {{"threshold": list(gc.get_threshold()), "frozen": gc.get_freeze_count()}}
        await ex.generate(0)
        for k in collections:
            collections[k] = 0
        sizes = []
        for i in (1, 2):
            out = await ex.generate(i)
            sizes.append(len(ray.get(out["data"][0]).tokens))
        await ex.dispose()
        return state, sizes

    with stand_in_engines(1, work) as urls:
        state, sizes = asyncio.run(go())
    print("RESULT " + json.dumps({{**state, "sizes": sizes, "collections": collections}}))
    """
)


def test_executor_keeps_full_collections_off_a_large_step():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, ray_cluster.address()],
        cwd=ROOT, env={**env, **ray_cluster.join_env()}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert r["sizes"] == [IN_FLIGHT, IN_FLIGHT]  # every sample of both steps came back
    # With the default thresholds, 2 steps of 4096 samples ran 6 full collections; now none.
    assert r["collections"]["2"] == 0, r
    assert tuple(r["threshold"]) == ROLLOUT_GC_THRESHOLDS
    assert r["frozen"] > 10_000  # what the tokenizer, torch and Ray left at start-up is out of the collector's reach


def test_stand_in_engines_answer_generate_and_control_calls():
    async def go():
        urls, servers, counter = await serve(3)
        try:
            assert len(set(urls)) == 3
            clients = [EngineClient(u, timeout=10) for u in urls]
            outs = await asyncio.gather(*(c.generate([1, 2, 3] * 500, {"max_new_tokens": 1}) for c in clients * 20))
            assert all(o["output_ids"] == [7] for o in outs)
            assert outs[0]["meta_info"]["finish_reason"]["type"] == "length"
            assert outs[0]["meta_info"]["output_token_weight_versions"] == [0]
            assert await clients[0].health()
            assert await clients[1].flush_cache() == {}
            with pytest.raises(EngineError) as err:
                await clients[2]._request("GET", "/not_an_endpoint")
            assert err.value.status == 404
            assert counter[0] == 60 + 3  # 60 generations over keep-alive connections, health, flush, the 404
            for c in clients:
                await c.close()
        finally:
            for s in servers:
                s.close()

    asyncio.run(go())
