"""Controlled workloads for the benchmarks, plugged in through the project's own plugin flags."""

from __future__ import annotations

import random

from miles_async.rollout.generate import generate_sample

PARETO_ALPHA = 1.2
MIN_TOKENS = 8


def target_length(uid: str, index: int, cap: int) -> int:
    """A heavy-tailed response length, fixed per (prompt, sample) so both modes see the same work."""
    u = random.Random(f"{uid}/{index}").random()
    return max(1, min(cap, int(MIN_TOKENS * (1.0 - u) ** (-1.0 / PARETO_ALPHA))))


async def long_tail_generate(ctx, sample, sampling_params):
    """Generate exactly target_length tokens (min = max), whatever the model would have said."""
    n = target_length(sample.uid, sample.index, sampling_params["max_new_tokens"])
    done = len(sample.response_tokens)
    params = {**sampling_params, "max_new_tokens": n, "min_new_tokens": max(0, n - done)}
    return await generate_sample(ctx, sample, params)


def constant_reward(sample) -> float:
    return float(sample.index % 2)  # a fixed advantage pattern: every group trains


async def fixed_length_generate(ctx, sample, sampling_params):
    """Generate exactly max_new_tokens tokens, so a rollout's cost is set by the engine's step cost."""
    n = sampling_params["max_new_tokens"] - len(sample.response_tokens)
    return await generate_sample(ctx, sample, {**sampling_params, "min_new_tokens": max(0, n)})
