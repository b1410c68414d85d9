"""The default rollout function: a batch of prompts -> groups of rewarded samples.

A custom rollout function (``--rollout-function-path``) has the signature of
``generate_rollout``: ``async fn(ctx: RolloutContext, rollout_id: int) -> list[list[Sample]]``.
With ``--dynamic-sampling-filter-path`` / ``--zero-variance-filter`` / ``--over-sampling-batch-size``
the draw goes through ``ctx.dynamic_sampling`` (``rollout/dynamic_sampling.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.dynamic_sampling import DynamicSampler
from miles_async.rollout.generate import GenerateContext, GenerateFn, encode_item
from miles_async.rollout.rewards import RewardModel
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.async_utils import gather_fail_fast

logger = logging.getLogger(__name__)

# An engine aborts requests only when paused in "abort" mode. Without partial rollouts such a
# sample is generated again from scratch at most this many times; with them it is resumed as
# often as it makes progress, and only this many aborts in a row without a new token fail it.
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
    partial_rollout: bool = False  # resume ABORTED samples from their tokens instead of regenerating
    mask_offpolicy_in_partial_rollout: bool = False  # train only tokens of a sample's newest weights
    dynamic_sampling: DynamicSampler | None = None  # over-sampling rounds and the group filter

    def prompt_tokens(self, item: PromptItem) -> list[int]:
        tokens = self.prompt_token_cache.get(item.uid)
        if tokens is None:
            ctx = self.generate_ctx
            tokens = encode_item(ctx.tokenizer, ctx.processor, item, self.apply_chat_template, ctx.template_kwargs)
            self.prompt_token_cache[item.uid] = tokens
        return tokens


async def _generate_until_done(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample:
    aborts_without_progress = 0
    restarts = 0
    while True:
        generated_before = sample.response_length
        sample = await ctx.generate_fn(ctx.generate_ctx, sample, sampling_params)
        if sample.status != SampleStatus.ABORTED:
            return sample
        if ctx.partial_rollout:
            # Progress shrinks the remaining budget, so only aborts that add nothing can repeat forever.
            progressed = sample.response_length > generated_before
            aborts_without_progress = 0 if progressed else aborts_without_progress + 1
            if aborts_without_progress > MAX_ABORT_RETRIES:
                raise RuntimeError(
                    f"sample uid={sample.uid} was aborted {aborts_without_progress} times in a row "
                    f"without generating a token"
                )
            if sample.response_tokens:  # with nothing kept, going again is a plain retry, not a resume
                sample.partial_resumes += 1
        else:
            restarts += 1
            if restarts > MAX_ABORT_RETRIES:
                raise RuntimeError(f"sample uid={sample.uid} was aborted {restarts} times in a row")
            sample.response_tokens, sample.rollout_logprobs, sample.weight_versions = [], [], []
            sample.response, sample.loss_mask, sample.status = "", None, SampleStatus.PENDING
            sample.routed_experts = None


async def generate_one(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample:
    async with ctx.semaphore:
        sample = await _generate_until_done(ctx, sample, sampling_params)
    if ctx.mask_offpolicy_in_partial_rollout:
        sample.offpolicy_masked_tokens = sample.mask_offpolicy_tokens()
    if not _scores_groups(ctx):
        sample.reward = await ctx.reward.score(sample)
    return sample


def _scores_groups(ctx: RolloutContext) -> bool:
    # A reward object without the attribute (a test's, a custom rollout's) scores sample by sample.
    return getattr(ctx.reward, "group_rm", False)


async def generate_group(
    ctx: RolloutContext, item: PromptItem, group_index: int, n: int, sampling_params: dict
) -> list[Sample]:
    tokens = ctx.prompt_tokens(item)
    samples = [
        Sample(
            uid=item.uid,
            group_index=group_index,
            index=i,
            prompt=item.prompt,
            label=item.label,
            metadata=dict(item.metadata),
            images=list(item.images),
            prompt_tokens=list(tokens),
        )
        for i in range(n)
    ]
    samples = await gather_fail_fast(generate_one(ctx, s, sampling_params) for s in samples)
    if _scores_groups(ctx):  # --group-rm: the reward sees the whole group once it is generated
        for sample, reward in zip(samples, await ctx.reward.score_group(samples), strict=True):
            sample.reward = reward
    return samples


async def generate_rollout(ctx: RolloutContext, rollout_id: int) -> list[list[Sample]]:
    if ctx.dynamic_sampling is not None:
        return await ctx.dynamic_sampling.sample(
            ctx.data_source,
            lambda item, gi: generate_group(ctx, item, gi, ctx.n_samples_per_prompt, ctx.sampling_params),
        )
    items = ctx.data_source.next_batch()
    return await gather_fail_fast(
        generate_group(ctx, item, gi, ctx.n_samples_per_prompt, ctx.sampling_params) for gi, item in enumerate(items)
    )
