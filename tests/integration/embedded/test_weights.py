"""Weights into a live embedded server: tensors in buckets while paused in place (the version flips with the last
bucket), a checkpoint folder from disk, and refusals that change nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from miles_async.inference.client import EngineError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from tests.integration.embedded.helpers import (
    GREEDY,
    LONG,
    ServerProc,
    hf_greedy,
    load_local,
    make_model,
    restore_base,
    run,
    wait_running,
)


def test_pause_in_place_weight_update_continue(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    alt = make_model(seed=1).state_dict()
    names = [n for n in alt if n != "lm_head.weight"]
    half = len(names) // 2

    async def body(c: EmbeddedEngineClient) -> tuple[int, dict, int, int]:
        v0 = (await c.model_info())["weight_version"]
        task = asyncio.create_task(c.generate([1, 4, 5, 6], LONG))
        await wait_running(c, 1)
        await asyncio.sleep(0.05)
        await c.pause("in_place")
        frozen = (await c.load())["decode_steps"]
        await asyncio.sleep(0.2)
        still = (await c.load())["decode_steps"]
        # Two buckets; the version flips with the last one.
        await c.update_weights_from_tensors([(n, alt[n]) for n in names[:half]], None, flush=False)
        r = await c.update_weights_from_tensors([(n, alt[n]) for n in names[half:]], v0 + 1, flush=True)
        assert r["weight_version"] == v0 + 1
        await c.resume()
        res = await asyncio.wait_for(task, 20)
        await restore_base(c, model_dirs["base"])
        return v0, res, frozen, still

    v0, res, frozen, still = run(body, server.url)
    assert frozen == still, "decoding continued while paused in place"
    versions = res["meta_info"]["output_token_weight_versions"]
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert len(versions) == len(res["output_ids"]) == 200
    assert v0 in versions and v0 + 1 in versions
    switch = versions.index(v0 + 1)
    assert versions[:switch] == [v0] * switch and versions[switch:] == [v0 + 1] * (200 - switch)
    assert res["meta_info"]["weight_version"] == v0 + 1


def test_update_weights_from_disk_and_tensor(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompt = [1, 20, 21, 22, 23]
    alt2 = make_model(seed=2).state_dict()

    async def body(c: EmbeddedEngineClient) -> dict[str, Any]:
        out: dict[str, Any] = {"v0": (await c.model_info())["weight_version"]}
        out["base"] = (await c.generate(prompt, GREEDY))["output_ids"]
        r = await c.update_weights_from_disk(str(model_dirs["alt"]), out["v0"] + 1)
        out["disk_resp"] = r
        out["info_after_disk"] = await c.model_info()
        out["alt"] = await c.generate(prompt, GREEDY)
        # Tied embeddings: send only lm_head.weight for the shared matrix.
        tensors = [(n, t.to(torch.bfloat16)) for n, t in alt2.items() if n != "model.embed_tokens.weight"]
        out["tensor_resp"] = await c.update_weights_from_tensors(tensors, out["v0"] + 2, flush=True)
        out["alt2"] = await c.generate(prompt, GREEDY)
        try:
            await c.update_weights_from_tensors([("model.no_such.weight", torch.zeros(3))], out["v0"] + 3, True)
        except EngineError as exc:
            out["unknown_error"] = exc
        out["info_after_error"] = await c.model_info()
        try:
            await c.update_weights_from_disk(str(model_dirs["base"] / "missing"), None)
        except EngineError as exc:
            out["disk_error"] = exc
        await restore_base(c, model_dirs["base"])
        out["restored"] = (await c.generate(prompt, GREEDY))["output_ids"]
        return out

    out = run(body, server.url)
    v0 = out["v0"]
    assert out["disk_resp"]["success"] and out["disk_resp"]["weight_version"] == v0 + 1
    assert out["info_after_disk"]["weight_version"] == v0 + 1
    assert out["info_after_disk"]["model_path"] == str(model_dirs["alt"])
    assert out["alt"]["meta_info"]["weight_version"] == v0 + 1
    assert out["alt"]["output_ids"] != out["base"]
    assert out["alt"]["output_ids"] == hf_greedy(load_local(model_dirs["alt"]), prompt, GREEDY["max_new_tokens"])

    assert out["tensor_resp"]["weight_version"] == v0 + 2
    assert out["alt2"]["meta_info"]["weight_version"] == v0 + 2
    assert out["alt2"]["output_ids"] != out["alt"]["output_ids"]
    ref2 = make_model(seed=2)
    ref2.load_state_dict({n: t.to(torch.bfloat16).float() for n, t in alt2.items()})
    assert out["alt2"]["output_ids"] == hf_greedy(ref2, prompt, GREEDY["max_new_tokens"])

    err = out["unknown_error"]
    assert err.status == 400 and "model.no_such.weight" in str(err)
    assert "/update_weights_from_tensor" in str(err) and server.url in str(err)
    assert out["info_after_error"]["weight_version"] == v0 + 2
    assert out["disk_error"].status == 400
    assert out["restored"] == out["base"]
