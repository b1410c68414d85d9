"""A trained policy's weights reach a real engine server: its version rises and its outputs change."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.arguments import parse_args
from miles_async.inference.client import EngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.rollout.generate import encode_prompt
from miles_async.weights.update import WeightUpdate
from tests.trainer_helpers import actor_trained_on, assert_engine_logprobs_match


@pytest.fixture
def cfg(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    return parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "4",
            "--rm-type",
            "first_integer",
            "--rollout-dtype",
            "float32",
            "--lr",
            "5e-2",
            "--update-weight-buffer-size",
            "20000",
            "--output-dir",
            str(tmp_path),
        ]
    )


@pytest.fixture
def engine(cfg, tmp_path):
    with EmbeddedEngineProcess(cfg.engine, 0, str(tmp_path)) as proc:
        yield proc


def _generate(url: str, key, prompts: list[list[int]], n_tokens: int = 6) -> list[dict]:
    async def go():
        async with EngineClient(url, timeout=60, api_key=key) as c:
            return await asyncio.gather(
                *[c.generate(p, {"temperature": 0.0, "max_new_tokens": n_tokens}) for p in prompts]
            )

    return asyncio.run(go())


def _info(url: str, key) -> dict:
    async def go():
        async with EngineClient(url, timeout=60, api_key=key) as c:
            return await c.model_info()

    return asyncio.run(go())


def test_trained_weights_reach_the_engine(cfg, engine, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [encode_prompt(tok, f"repeat {d}", True) for d in range(4)]
    before = _generate(engine.url, cfg.engine.api_key, prompts)
    assert _info(engine.url, cfg.engine.api_key)["weight_version"] == 0

    # Reward the greedy outputs negatively: a policy step must move away from them.
    actor = actor_trained_on(cfg, prompts, before)
    pushed = actor.push_weights(
        WeightUpdate(
            version=3,
            route="http",
            dtype="float32",
            timeout=60,
            targets=(engine.url,),
            bucket_bytes=cfg.train.update_weight_buffer_size,
            api_key=cfg.engine.api_key,
        )
    )
    assert pushed["weights/bytes"] > 0

    assert _info(engine.url, cfg.engine.api_key)["weight_version"] == 3
    after = _generate(engine.url, cfg.engine.api_key, prompts)
    assert all(o["meta_info"]["weight_version"] == 3 for o in after)
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    # The engine now computes what the trainer holds: its log-probs match the trainer's own.
    assert_engine_logprobs_match(actor, prompts, after)
