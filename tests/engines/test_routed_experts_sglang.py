"""An MoE model on SGLang's real CPU server (one server for the module), a tiny Qwen3-MoE with its own output layer.

Rollout routing replay (R3): started under ``--use-rollout-routing-replay`` (the launcher then adds
``--enable-return-routed-experts``), the server returns for each request that asks the experts every layer's router
chose at each position of prompt + output but the last (``meta_info.routed_experts``, decoded by
``miles_async.inference.routed_experts.decode``), and they are those of a transformers forward of the whole sequence.
SGLang computes in float32 here too, but
with its own kernels: expert sets are compared where the reference's top-k is clear of a tie by ``TIE`` (nearly
every position must be). Batched: two prompt lengths, a prompt twice (the second from SGLang's prefix cache, its
routing from the first's forward), a start past 0 and at the prompt's end, and a request not asking.

Without the CPU shim of ``cpu_shims/sitecustomize.py`` (SGLang's routed-experts host buffer pinned with
cudaHostRegister) this server dies at start-up.

Trained weights (last, as they change the server's model): the torch backend pushes them through
/update_weights_from_tensor, and the engine's log-probs of its own greedy outputs then equal the trainer's.
transformers 5 holds the routed experts fused (``mlp.experts.gate_up_proj``) where SGLang loads each expert's
projections by the checkpoint's names: the trainer sends those (utils/hf_names.py). SGLang's loader skips a name it
does not know without a word, so only the log-probs show whether the experts arrived (an engine with the experts of
before fails assert_engine_logprobs_match's comparison). vLLM's CPU build is not run on an MoE here.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.inference.routed_experts import decode
from miles_async.weights.update import WeightUpdate, route_for
from tests.routing_helpers import routing_reference
from tests.trainer_helpers import assert_engine_logprobs_match

ENGINE = "sglang"
TIE = 1e-3
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def backend() -> str:
    return ENGINE


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top 2) with head size 32, which SGLang's CPU attention takes, and its own output
    layer, as Qwen3-30B-A3B has (with the embeddings tied, SGLang's CPU server gave every token the same logit, as if
    its Qwen3-MoE head were never loaded); its routers scaled up so that tokens spread over the experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_async.assets.tiny_model import make_tiny_model

    tied = make_tiny_model(tmp_path_factory.mktemp("r3_moe_tied"), seed=2, arch="qwen3_moe", head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10)
    out = tmp_path_factory.mktemp("r3_moe")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tied).save_pretrained(out)
    return out, model.eval()


def _argv(model, train, out) -> list[str]:
    return ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rm-type", "first_integer", "--rollout-dtype",
            "float32", "--use-tis", "--output-dir", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def engine(backend, engine_python, tiny_moe, tiny_task, tmp_path_factory):
    train, _ = tiny_task
    path, _ = tiny_moe
    cfg = parse_args(
        _argv(path, train, tmp_path_factory.mktemp("r3_out"))
        + ["--use-rollout-routing-replay", "--rollout-backend", backend, f"--{backend}-python", engine_python,
           "--engine-startup-timeout", "400"]
    )  # fmt: skip
    assert cfg.engine.return_routed_experts
    proc = make_engine_process(cfg.engine, 0, str(tmp_path_factory.mktemp("r3_logs")))
    assert "--enable-return-routed-experts" in proc.command()
    with proc:
        yield proc


def _assert_matches(out: dict, prompt: list[int], model, start: int = 0) -> None:
    full = prompt + out["output_ids"]
    cfg = model.config
    got = decode(out["meta_info"]["routed_experts"], cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert got.shape == (len(full) - 1 - start, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    ref, clear = routing_reference(model, full, TIE)
    ref, clear = ref[start:-1], clear[start:-1]
    assert clear.mean() > 0.85, f"too many near-ties to compare ({(~clear).sum()} of {clear.size})"
    same = (np.sort(got, axis=-1) == np.sort(ref, axis=-1)).all(-1)
    bad = np.argwhere(~same & clear)
    assert not len(bad), f"experts differ at (position - start, layer) {bad[:5].tolist()}"


def test_sglang_routed_experts_match_transformers(backend, engine, tiny_moe):
    _, model = tiny_moe
    short, long = [4, 9, 17, 30], [6, 11, 23, 8, 40, 13, 27, 19, 33, 12]

    async def go() -> list[dict]:
        async with make_client(backend, engine.url, 120, engine.cfg.api_key) as c:
            first = await c.generate(long, GREEDY, return_routed_experts=True)
            return [first] + await asyncio.gather(
                c.generate(short, GREEDY, return_routed_experts=True),
                c.generate(long, GREEDY, return_routed_experts=True, routed_experts_start_len=4),
                c.generate(long, GREEDY, return_routed_experts=True, routed_experts_start_len=len(long)),
                c.generate(short, GREEDY),
            )

    outs = asyncio.run(go())
    _assert_matches(outs[0], long, model)
    _assert_matches(outs[1], short, model)
    _assert_matches(outs[2], long, model, start=4)
    _assert_matches(outs[3], long, model, start=len(long))
    assert outs[2]["meta_info"]["cached_tokens"] > 0  # its prompt's routing came from the first request's forward
    assert "routed_experts" not in outs[4]["meta_info"]


def test_trained_moe_weights_reach_sglang(backend, engine, tiny_moe, tiny_task, tmp_path):
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    train, _ = tiny_task
    path, _ = tiny_moe
    cfg = parse_args(_argv(path, train, tmp_path / "out"))
    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    with torch.no_grad():  # "trained" weights: a visible change, the experts' included
        for _, p in actor.module.named_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = [[5 + d, 9, 17, 30 - d] for d in range(4)]

    async def generate_all():
        async with make_client(backend, engine.url, 120, engine.cfg.api_key) as c:
            return await asyncio.gather(*[c.generate(p, greedy) for p in prompts])

    try:
        update = WeightUpdate(version=3, route=route_for("tensor", backend), dtype="float32", timeout=60,
                              targets=(engine.url,), engine=backend, bucket_bytes=64 * 1024,
                              api_key=engine.cfg.api_key)  # fmt: skip
        actor.push_weights(update)
        outs = asyncio.run(generate_all())
    finally:
        actor._weight_sender.close()
    assert all(o["meta_info"]["weight_version"] == 3 for o in outs)
    assert_engine_logprobs_match(actor, prompts, outs)
