"""Rollout routing replay (R3) on the embedded server: ``/generate`` with ``return_routed_experts`` returns, for every
position of prompt + output but the last, the experts each layer's router chose, in SGLang's format
(``miles_async/inference/routed_experts.py``), and they are the experts an independent transformers forward of the
whole sequence chooses.

Two tiny MoE families: Qwen3-MoE (softmax router, every layer MoE) and GLM-4.5 (sigmoid router with an expert bias,
its first layer dense: SGLang's 0s there). Covered: a start past 0, different prompt lengths in one prefill (left
padding), identical prompts (one prefill, rows copied), a request not asking (no field), a flush mid-generation with
new router weights (the re-prefill's routing replaces the earlier one: the whole sequence then matches the new
weights' forward), a dense model and a start outside the prompt (400 naming the field). Expert sets are compared
where the reference's top-k is clear of a tie by ``TIE``; nearly every position must be.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles_async.inference.client import EngineError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.routed_experts import decode, encode
from tests.integration.embedded.helpers import KEY, ServerProc, run, wait_running
from tests.routing_helpers import routing_reference

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
TIE = 1e-4  # a top-k whose k-th and (k+1)-th scores are closer is a near-tie: float noise may flip it
TOPK = 2


def _qwen3_moe(path: Path) -> Path:
    """The tiny Qwen3-MoE, its routers scaled up so that tokens spread over the experts."""
    from miles_async.assets.tiny_model import make_tiny_model

    make_tiny_model(path, seed=2, arch="qwen3_moe", head_dim=32, tied=False)
    model = _load(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10)
    model.save_pretrained(path)
    return path


def _glm4_moe(path: Path) -> Path:
    """A tiny GLM-4.5: sigmoid router with a (random, so it matters) expert-score bias, layer 0 dense."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    from miles_async.assets.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = Glm4MoeConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=TOPK,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _assert_matches(out: dict[str, Any], prompt: list[int], model: Any, start: int = 0) -> None:
    full = prompt + out["output_ids"]
    layers = model.config.num_hidden_layers
    got = decode(out["meta_info"]["routed_experts"], layers, TOPK)
    assert got.shape == (len(full) - 1 - start, layers, TOPK)
    ref, clear = routing_reference(model, full, TIE)
    ref, clear = ref[start:-1], clear[start:-1]
    assert clear.mean() > 0.9, f"too many near-ties to compare ({(~clear).sum()} of {clear.size})"
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    routes = {tuple(sorted(r)) for r in got[:, moe_layers].reshape(-1, TOPK).tolist()}
    assert len(routes) >= 3, f"too few distinct routes to tell rows apart: {routes}"
    same = np.sort(got, axis=-1) == np.sort(ref, axis=-1)
    bad = np.argwhere(~same.all(-1) & clear)
    assert not len(bad), (
        f"experts differ at (position - start, layer) {bad[:5].tolist()}: {got[tuple(bad[0])]} != {ref[tuple(bad[0])]}"
    )
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "experts"):
            assert (got[:, i] == 0).all(), f"dense layer {i} must hold 0s (as SGLang's)"


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Both MoE servers, started side by side, and each one's HF model."""
    root = tmp_path_factory.mktemp("routed_experts")
    dirs = {"qwen3_moe": _qwen3_moe(root / "qwen3_moe"), "glm4_moe": _glm4_moe(root / "glm4_moe")}
    servers = {name: ServerProc(d, root / f"{name}.log", port=0) for name, d in dirs.items()}
    try:
        for srv in servers.values():
            srv.wait_healthy()
        yield {name: (servers[name], _load(d), d) for name, d in dirs.items()}
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_routed_experts_match_transformers(moe, arch):
    srv, model, _ = moe[arch]
    short, long = [4, 9, 17, 30], [6, 11, 23, 8, 40, 13, 27, 19, 33, 12]

    async def go(c: EmbeddedEngineClient) -> list[dict]:
        # One prefill (all queued while paused): two lengths (left padding), a prompt 4 times (one row, copied).
        before = await c.load()
        await c.pause("in_place")
        tasks = [
            asyncio.ensure_future(c.generate(short, GREEDY, return_routed_experts=True)),
            asyncio.ensure_future(c.generate(long, GREEDY, return_routed_experts=True, routed_experts_start_len=4)),
            asyncio.ensure_future(c.generate(long, GREEDY, return_routed_experts=True)),
            asyncio.ensure_future(c.generate(long, GREEDY)),
            asyncio.ensure_future(c.generate(long, GREEDY, return_routed_experts=True, routed_experts_start_len=10)),
        ]
        while (await c.load())["num_waiting_reqs"] < len(tasks):
            await asyncio.sleep(0.01)
        await c.resume()
        outs = await asyncio.gather(*tasks)
        after = await c.load()
        assert after["prefill_batches"] == before["prefill_batches"] + 1
        assert after["prefill_rows_deduplicated"] == before["prefill_rows_deduplicated"] + 3
        return outs

    outs = run(go, srv.url)
    _assert_matches(outs[0], short, model)
    _assert_matches(outs[1], long, model, start=4)
    _assert_matches(outs[2], long, model)
    assert "routed_experts" not in outs[3]["meta_info"]
    _assert_matches(outs[4], long, model, start=len(long))
    assert outs[1]["meta_info"]["routed_experts"] != outs[2]["meta_info"]["routed_experts"]


def test_flush_with_new_router_weights_recomputes_routing(moe):
    """A flush mid-generation re-prefills prompt + output: the routing of every position is then the new weights',
    which the cache every later token attends to comes from."""
    srv, model, path = moe["qwen3_moe"]
    prompt = [4, 9, 17, 30, 5]
    long = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    new = _load(path)
    with torch.no_grad():
        for layer in new.model.layers:
            layer.mlp.gate.weight.copy_(torch.roll(layer.mlp.gate.weight, 1, dims=0))  # each expert's router row moves
    gates = [
        (f"model.layers.{i}.mlp.gate.weight", layer.mlp.gate.weight.detach().clone())
        for i, layer in enumerate(new.model.layers)
    ]
    old = [(n, model.state_dict()[n].clone()) for n, _ in gates]

    async def go(c: EmbeddedEngineClient) -> dict:
        task = asyncio.ensure_future(c.generate(prompt, long, return_routed_experts=True))
        await wait_running(c, 1)
        before = (await c.load())["prefill_batches"]
        await c.update_weights_from_tensors(gates, weight_version=1, flush=True)
        out = await task
        assert (await c.load())["prefill_batches"] == before + 1, "the request was not re-prefilled"
        await c.update_weights_from_tensors(old, weight_version=2, flush=True)
        return out

    out = run(go, srv.url)
    assert len(out["output_ids"]) == 200 and 0 in out["meta_info"]["output_token_weight_versions"]
    _assert_matches(out, prompt, new)


def test_routed_experts_refused_where_there_are_none(moe, server):
    """400 naming the field: a dense model (the package's tiny llama), a start outside the prompt."""
    srv = moe["qwen3_moe"][0]

    async def ask(url: str, **kw: Any) -> EngineError:
        async with EmbeddedEngineClient(url, timeout=30, api_key=KEY) as c:
            with pytest.raises(EngineError) as err:
                await c.generate([3, 4, 5], GREEDY, **kw)
        return err.value

    dense = asyncio.run(ask(server.url, return_routed_experts=True))
    assert dense.status == 400 and "return_routed_experts" in dense.message and "MoE" in dense.message
    late = asyncio.run(ask(srv.url, return_routed_experts=True, routed_experts_start_len=4))
    assert late.status == 400 and "routed_experts_start_len" in late.message
    assert json.dumps(run(lambda c: c.generate([3, 4, 5], GREEDY), server.url)["meta_info"]).count("routed") == 0


def test_routed_experts_format_is_sglangs():
    """encode writes what SGLang's detokenizer writes (base64 of the int32 bytes); decode reads it back and names
    the sizes when the bytes do not divide into rows."""
    a = np.arange(24, dtype=np.int64).reshape(3, 4, 2)
    assert encode(a) == base64.b64encode(a.astype(np.int32).tobytes()).decode()
    assert (decode(encode(a), 4, 2) == a).all() and decode(encode(a), 4, 2).dtype == np.int32
    assert decode("", 4, 2).shape == (0, 4, 2)
    with pytest.raises(ValueError, match="96 bytes .* 5 layers x 2 experts"):
        decode(encode(a), 5, 2)
    with pytest.raises(ValueError, match="base64"):
        decode("not base64!", 4, 2)
