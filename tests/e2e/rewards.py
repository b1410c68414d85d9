"""Reward plugins used by the end-to-end tests (loaded through --custom-rm-path)."""

import os
from pathlib import Path


def starts_with_digit(sample) -> float:
    """Learnable by a random tiny model in a handful of GRPO steps: only a bias towards digits is needed."""
    text = sample.response.lstrip()
    return float(bool(text) and text[0].isdigit())


def fails_on_third_rollout(sample) -> float:
    """Raises once the marker file says two rollouts were scored, to induce a mid-run failure."""
    marker = Path(os.environ["MILES_ASYNC_TEST_MARKER"])
    count = int(marker.read_text()) if marker.exists() else 0
    marker.write_text(str(count + 1))
    if count >= 2 * 32:
        import time

        Path(str(marker) + ".raised").write_text(str(time.time()))
        raise RuntimeError("induced reward failure")
    return starts_with_digit(sample)


def always_fails(sample) -> float:
    raise ValueError("broken verifier")


async def stall_once(ctx, sample, sampling_params):
    """A generate function whose first call stalls for 4 s: an engine that stopped making progress."""
    import asyncio

    from miles_async.rollout.generate import generate_sample

    marker = Path(os.environ["MILES_ASYNC_TEST_MARKER"])
    if not marker.exists():
        marker.write_text("stalled")
        await asyncio.sleep(4)
    return await generate_sample(ctx, sample, sampling_params)


async def drops_rollout_logprobs(ctx, sample, sampling_params):
    """Loses the engine's log-probs of each group's second sample, as a generate function that builds its own
    responses might; appends the uids it hit to the marker file."""
    from miles_async.rollout.generate import generate_sample

    sample = await generate_sample(ctx, sample, sampling_params)
    if sample.index == 1 and sample.response_tokens:
        sample.rollout_logprobs = []
        _append_line(Path(os.environ["MILES_ASYNC_TEST_MARKER"]), sample.uid)
    return sample


def _append_line(path: Path, line: str) -> None:
    with path.open("a") as fh:
        fh.write(line + "\n")


def always_zero(sample) -> float:
    """A verifier that never accepts anything: every group has zero reward variance."""
    return 0.0


def flat_on_odd_label(sample) -> float:
    """Every sample of a prompt with an odd label gets 1 (a zero-variance group, for dynamic sampling to drop);
    the groups of the other prompts get 1 for their first sample and 0 for the rest."""
    if int(sample.label) % 2:
        return 1.0
    return float(sample.index == 0)


def nonzero_std(args, samples, **kwargs):
    """A dynamic-sampling filter written as for Miles/slime: rewards through ``get_reward_value``, a tensor verdict."""
    import torch

    from miles_async.rollout.filters import DynamicFilterOutput

    rewards = [s.get_reward_value(args) for s in samples]
    keep = torch.tensor(rewards, dtype=torch.float).std() > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


def starts_with_digit_failing_evals(sample) -> float:
    """starts_with_digit, but raises for the held-out prompts (tiny_task's eval uids): every eval fails."""
    if sample.uid.startswith("tiny-eval-"):
        raise ValueError("induced eval failure")
    return starts_with_digit(sample)
