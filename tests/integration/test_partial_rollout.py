"""Partial rollouts against a real engine: abort mid-generation, swap weights, resume."""

from __future__ import annotations

import asyncio
import math

import pytest
import requests

from benchmarks.engine_doubles import fixed_step_cost_env
from miles_async.config import EngineConfig
from miles_async.inference.auth import auth_headers
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.router import make_router
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import GenerateContext, generate_sample
from miles_async.rollout.rollout import RolloutContext, generate_group
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.api_key import new_api_key

MAX_NEW = 200
N_SAMPLES = 4
# min_new_tokens = max_new_tokens bans EOS, so every sample must come back with exactly MAX_NEW tokens.
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW}


KEY = new_api_key()  # the engine's key, which every call below sends


class SlowEngine(EmbeddedEngineProcess):
    """An engine whose decode steps are slowed (an engine double), so a pause reliably lands mid-generation."""

    def env(self) -> dict:
        return {**super().env(), **fixed_step_cost_env(0.01)}


class ZeroReward:
    async def score(self, sample: Sample) -> float:
        return 0.0


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    from miles_async.assets.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model_b"), seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    # One torch thread: on a small shared CPU box two threads contend and decode ~50x slower.
    cfg = EngineConfig(
        backend="embedded",
        model_path=str(tiny_model),
        num_engines=1,
        dtype="float32",
        max_running_requests=16,
        num_threads=1,
        host="127.0.0.1",
        startup_timeout=120.0,
        request_timeout=60.0,
        seed=0,
        api_key=KEY,
    )
    proc = SlowEngine(cfg, 0, str(tmp_path_factory.mktemp("engine_logs")))
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


async def _wait_until_generating(url: str, min_new_tokens: int, prompt_len: int) -> None:
    """Return once every sample is decoding and has some, but far from all, of its tokens."""
    for _ in range(2000):
        load = await asyncio.to_thread(
            lambda: requests.get(url + "/get_load", headers=auth_headers(KEY), timeout=10).json()
        )
        if load["num_running_reqs"] == N_SAMPLES and load["num_tokens"] >= N_SAMPLES * (prompt_len + min_new_tokens):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the engine never got {min_new_tokens} tokens into every sample: {load}")


async def _rollout_with_updates(url: str, tokenizer, weights: list[str], partial: bool, mask: bool) -> list[Sample]:
    """Generate one group, pausing in abort mode once per entry of ``weights`` to load it."""
    router = make_router([url], 60.0, api_key=KEY)
    client = EmbeddedEngineClient(url, timeout=60.0, api_key=KEY)
    try:
        ctx = RolloutContext(
            data_source=None,
            generate_ctx=GenerateContext(router, tokenizer),
            generate_fn=generate_sample,
            reward=ZeroReward(),
            apply_chat_template=False,
            n_samples_per_prompt=N_SAMPLES,
            sampling_params=PARAMS,
            semaphore=asyncio.Semaphore(N_SAMPLES),
            partial_rollout=partial,
            mask_offpolicy_in_partial_rollout=mask,
        )
        item = PromptItem(uid="p0", prompt="what is 12 + 30?", label=None, metadata={})
        prompt_len = len(ctx.prompt_tokens(item))
        version = (await client.model_info())["weight_version"]
        task = asyncio.create_task(generate_group(ctx, item, 0, N_SAMPLES, PARAMS))
        for i, path in enumerate(weights):
            await _wait_until_generating(url, 20 + 40 * i, prompt_len)
            await client.pause("abort")
            try:
                version += 1
                await client.update_weights_from_disk(path, weight_version=version)
            finally:
                await client.resume()
        return await asyncio.wait_for(task, 60)
    finally:
        await router.close()
        await client.close()


def _blocks(versions: list[int]) -> list[tuple[int, int]]:
    """Run-length encoding: [(version, count), ...] in order."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def _check_complete(s: Sample, tokenizer) -> None:
    assert s.status == SampleStatus.TRUNCATED
    assert s.response_length == MAX_NEW
    assert len(s.rollout_logprobs) == MAX_NEW and len(s.weight_versions) == MAX_NEW
    assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_logprobs)
    assert s.tokens == s.prompt_tokens + s.response_tokens
    assert s.response == tokenizer.decode(s.response_tokens, skip_special_tokens=True)


def test_resumed_samples_continue_under_the_new_weights(engine, tokenizer, tiny_model, second_model):
    group = asyncio.run(_rollout_with_updates(engine.url, tokenizer, [str(second_model)], partial=True, mask=True))
    assert len(group) == N_SAMPLES
    for s in group:
        _check_complete(s, tokenizer)
        (old, n_old), (new, n_new) = _blocks(s.weight_versions)
        assert new == old + 1 and 0 < n_old < MAX_NEW and n_old + n_new == MAX_NEW
        assert s.partial_resumes == 1
        assert s.loss_mask == [0] * n_old + [1] * n_new  # only the newest policy's tokens are trained


def test_a_sample_can_be_resumed_several_times(engine, tokenizer, tiny_model, second_model):
    group = asyncio.run(
        _rollout_with_updates(engine.url, tokenizer, [str(tiny_model), str(second_model)], partial=True, mask=False)
    )
    for s in group:
        _check_complete(s, tokenizer)
        blocks = _blocks(s.weight_versions)
        assert [v for v, _ in blocks] == [blocks[0][0] + i for i in range(3)]
        assert s.partial_resumes == 2
        assert s.loss_mask is None


def test_without_partial_rollout_aborted_samples_start_over(engine, tokenizer, tiny_model):
    group = asyncio.run(_rollout_with_updates(engine.url, tokenizer, [str(tiny_model)], partial=False, mask=False))
    for s in group:
        _check_complete(s, tokenizer)
        assert len(_blocks(s.weight_versions)) == 1  # every token from the weights after the update
        assert s.partial_resumes == 0
