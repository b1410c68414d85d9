"""Groups of samples -> the columnar batch the trainers consume, plus rollout metrics."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from miles_async.rollout.sample import Sample, SampleStatus


@dataclass(frozen=True)
class RolloutBatch:
    """One rollout's samples, column by column (row ``i`` of every column is sample ``i``): what the rollout
    executor puts in Ray's object store and every training worker reads. Plain lists, cheap to pickle."""

    tokens: list[list[int]]  # prompt + response
    prompt_lengths: list[int]
    response_lengths: list[int]
    loss_masks: list[list[int]]  # one per response token: 1 where it is trained
    rollout_logprobs: list[list[float]]  # the engine's, one per response token (a custom generate may leave none)
    weight_versions: list[list[int]]  # the engine weight version that generated each response token
    rewards: list[float]
    group_index: list[int]
    uids: list[str]
    images: list[list[str]] | None = None  # each sample's image references (Sample.images); None: no sample has one
    # Each sample's routing record (Sample.routed_experts, a numpy array); None: no sample has one.
    routed_experts: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for f in fields(self):
            if getattr(self, f.name) is not None and len(getattr(self, f.name)) != n:
                raise ValueError(f"RolloutBatch: {len(getattr(self, f.name))} {f.name} for {n} samples")
        for i, (tokens, p, r, mask) in enumerate(
            zip(self.tokens, self.prompt_lengths, self.response_lengths, self.loss_masks)
        ):
            where = f"RolloutBatch: sample uid={self.uids[i]} (index {i})"
            if len(tokens) != p + r:
                raise ValueError(f"{where} has {len(tokens)} tokens for a prompt of {p} and a response of {r}")
            if len(mask) != r:
                raise ValueError(
                    f"{where} has a loss mask of {len(mask)} for {r} response tokens (Sample.loss_mask, "
                    f"e.g. from a custom generate function, needs one entry per response token)"
                )

    def __len__(self) -> int:
        return len(self.tokens)


def to_train_batch(groups: list[list[Sample]]) -> RolloutBatch:
    samples = [s for g in groups for s in g]
    return RolloutBatch(
        tokens=[s.tokens for s in samples],
        prompt_lengths=[len(s.prompt_tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.effective_loss_mask() for s in samples],
        rollout_logprobs=[s.rollout_logprobs for s in samples],
        weight_versions=[s.weight_versions for s in samples],
        rewards=[float(s.reward) for s in samples],
        group_index=[s.group_index for s in samples],
        uids=[s.uid for s in samples],
        images=[list(s.images) for s in samples] if any(s.images for s in samples) else None,
        routed_experts=[s.routed_experts for s in samples]
        if any(s.routed_experts is not None for s in samples)
        else None,
    )


def tool_call_frac(samples: list[Sample]) -> float | None:
    """The fraction of samples whose model wrote a turn after a tool's response (``turns > 1``: it called a tool
    and went on), or None when no sample came from multi-turn generation (``turns`` is 0 for single-turn)."""
    if not samples or not any(s.turns for s in samples):
        return None
    return sum(s.turns > 1 for s in samples) / len(samples)


def rollout_metrics(groups: list[list[Sample]], prefix: str = "rollout") -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    rewards = [float(s.reward or 0.0) for s in samples]
    lengths = [s.response_length for s in samples]
    versions = [v for s in samples for v in s.weight_versions]
    zero_var = sum(1 for g in groups if len({s.reward for s in g}) <= 1)
    out = {
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        f"{prefix}/response_len_mean": statistics.fmean(lengths),
        f"{prefix}/response_len_max": max(lengths),
        f"{prefix}/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        f"{prefix}/num_samples": len(samples),
        f"{prefix}/zero_variance_group_frac": zero_var / len(groups),
        f"{prefix}/started_at": min(s.started_at for s in samples),
        f"{prefix}/finished_at": max(s.finished_at for s in samples),
        f"{prefix}/partial_resumed_samples": sum(s.partial_resumes > 0 for s in samples),
        f"{prefix}/offpolicy_masked_tokens": sum(s.offpolicy_masked_tokens for s in samples),
    }
    tool_frac = tool_call_frac(samples)
    if tool_frac is not None:
        out[f"{prefix}/tool_call_frac"] = tool_frac
    if versions:
        out[f"{prefix}/weight_version_min"] = min(versions)
        out[f"{prefix}/weight_version_max"] = max(versions)
    return out
