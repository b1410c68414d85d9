"""Held-out evaluation: generate with eval sampling params, score, report accuracy per dataset."""

from __future__ import annotations

import statistics

from miles_async.config import EvalConfig
from miles_async.rollout.batch import tool_call_frac
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.rollout import RolloutContext, generate_group
from miles_async.utils.async_utils import gather_fail_fast


async def evaluate(ctx: RolloutContext, cfg: EvalConfig, datasets: dict[str, list[PromptItem]]) -> dict[str, float]:
    params = cfg.sampling.to_sglang()
    metrics: dict[str, float] = {}
    for name, items in datasets.items():
        groups = await gather_fail_fast(
            generate_group(ctx, item, gi, cfg.n_samples_per_prompt, params) for gi, item in enumerate(items)
        )
        samples = [s for g in groups for s in g]
        versions = [v for s in samples for v in s.weight_versions]
        metrics[f"eval/{name}/accuracy"] = statistics.fmean(float(s.reward) for s in samples)
        metrics[f"eval/{name}/response_len_mean"] = statistics.fmean(s.response_length for s in samples)
        metrics[f"eval/{name}/num_samples"] = len(samples)
        tool_frac = tool_call_frac(samples)
        if tool_frac is not None:
            metrics[f"eval/{name}/tool_call_frac"] = tool_frac
        if versions:
            metrics[f"eval/{name}/weight_version_min"] = min(versions)
            metrics[f"eval/{name}/weight_version_max"] = max(versions)
    return metrics
