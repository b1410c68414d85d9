"""The default rollout function: a batch of prompts -> groups of rewarded samples.

A custom rollout function (``--rollout-function-path``) has the signature of
``generate_rollout``: ``async fn(ctx: RolloutContext, rollout_id: int) -> list[list[Sample]]``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import GenerateContext, GenerateFn, encode_prompt
from miles_async.rollout.rewards import RewardModel
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.async_utils import gather_fail_fast

logger = logging.getLogger(__name__)

# An engine aborts requests only when paused in "abort" mode; such a sample is generated
# again from scratch (partial rollouts keep its tokens instead) a bounded number of times.
MAX_ABORT_RETRIES = 3


@dataclass
class RolloutContext:
    data_source: Any
    generate_ctx: GenerateContext
    generate_fn: GenerateFn
    reward: RewardModel
    apply_chat_template: bool
    n_samples_per_prompt: int
    sampling_params: dict
    semaphore: asyncio.Semaphore
    prompt_token_cache: dict[str, list[int]] = field(default_factory=dict)

    def prompt_tokens(self, item: PromptItem) -> list[int]:
        tokens = self.prompt_token_cache.get(item.uid)
        if tokens is None:
            tokens = encode_prompt(self.generate_ctx.tokenizer, item.prompt, self.apply_chat_template)
            self.prompt_token_cache[item.uid] = tokens
        return tokens


async def generate_one(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample:
    async with ctx.semaphore:
        for _ in range(MAX_ABORT_RETRIES + 1):
            sample = await ctx.generate_fn(ctx.generate_ctx, sample, sampling_params)
            if sample.status != SampleStatus.ABORTED:
                break
            sample.response_tokens, sample.rollout_logprobs, sample.weight_versions = [], [], []
        else:
            raise RuntimeError(f"sample uid={sample.uid} was aborted {MAX_ABORT_RETRIES + 1} times in a row")
    sample.reward = await ctx.reward.score(sample)
    return sample


async def generate_group(ctx: RolloutContext, item: PromptItem, group_index: int, n: int,
                         sampling_params: dict) -> list[Sample]:
    tokens = ctx.prompt_tokens(item)
    samples = [Sample(uid=item.uid, group_index=group_index, index=i, prompt=item.prompt, label=item.label,
                      metadata=dict(item.metadata), prompt_tokens=list(tokens)) for i in range(n)]
    return await gather_fail_fast(generate_one(ctx, s, sampling_params) for s in samples)


async def generate_rollout(ctx: RolloutContext, rollout_id: int) -> list[list[Sample]]:
    items = ctx.data_source.next_batch()
    return await gather_fail_fast(generate_group(ctx, item, gi, ctx.n_samples_per_prompt, ctx.sampling_params)
                                  for gi, item in enumerate(items))
