"""An MoE model's trained weights reach SGLang's real CPU server: the torch backend on a tiny Qwen3-MoE pushes
them through /update_weights_from_tensor, and the engine's log-probs of its own greedy outputs then equal the
trainer's. transformers 5 holds the routed experts fused (``mlp.experts.gate_up_proj``) where SGLang loads each
expert's projections by the checkpoint's names: the trainer sends those (utils/hf_names.py). SGLang's loader
skips a name it does not know without a word, so only the log-probs show whether the experts arrived (an engine
with the experts of before fails assert_engine_logprobs_match's comparison). vLLM's CPU build is not run on an MoE
here."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.weights.update import WeightUpdate, route_for
from tests.trainer_helpers import assert_engine_logprobs_match

ENGINE = "sglang"


@pytest.fixture(scope="module")
def backend() -> str:
    return ENGINE


@pytest.fixture(scope="module")
def tiny_moe_hd32(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top 2) with head size 32, which SGLang's CPU attention takes, and its own
    output layer, as Qwen3-30B-A3B has: with the embeddings tied, SGLang's CPU server gave every token the same logit
    (log-prob -ln 54 throughout), as if its Qwen3-MoE head were never loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_async.assets.tiny_model import make_tiny_model

    tied = make_tiny_model(tmp_path_factory.mktemp("tiny_moe_tied"), seed=2, arch="qwen3_moe", head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 2)
    out = tmp_path_factory.mktemp("tiny_moe_hd32")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tied).save_pretrained(out)
    return out


def test_trained_moe_weights_reach_sglang(backend, engine_python, tiny_moe_hd32, tiny_task, tmp_path):
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    train, _ = tiny_task
    cfg = parse_args(
        ["--hf-checkpoint", str(tiny_moe_hd32), "--prompt-data", str(train), "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rm-type", "first_integer", "--rollout-dtype",
         "float32", "--use-tis", "--rollout-backend", backend, f"--{backend}-python", engine_python,
         "--engine-startup-timeout", "400", "--output-dir", str(tmp_path / "out")]
    )  # fmt: skip
    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    with torch.no_grad():  # "trained" weights: a visible change, the experts' included
        for _, p in actor.module.named_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = [[5 + d, 9, 17, 30 - d] for d in range(4)]
    with make_engine_process(cfg.engine, 0, str(tmp_path / "logs")) as engine:

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
