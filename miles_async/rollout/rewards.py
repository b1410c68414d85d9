"""Rewards hub: built-in reward types by ``--rm-type`` or a sample's metadata ``rm_type`` (``reward_types``),
user functions by ``--custom-rm-path`` and a reward server by ``--rm-url`` (``remote_reward``).

A custom reward is ``fn(sample: Sample) -> float`` or an ``async def`` of the same shape; under
``--group-rm`` (Miles/slime's flag) it is ``fn(samples: list[Sample]) -> list[float]``, given the
n samples of one prompt at once (pairwise / ranking reward models), and the rollout scores each
group once all its samples are generated (``score_group``). A reward returned as an object is
read from its ``--reward-key``.

Error policy (``--reward-on-error``): with ``raise`` (the default) a reward function that
raises fails the rollout with ``RewardError`` naming the sample's uid and the original
traceback; the run then shuts down cleanly instead of training on a silently wrong reward.
With ``zero`` the sample gets reward 0.0 and the failure is counted in the rollout
metrics (``rollout/reward_errors``) and logged once per rollout.

The types that compare with math-verify (``math``, ``deepscaler``, ``dapo``) run in worker processes
(``verifier_pool``): an answer whose check takes longer than ``MATH_VERIFY_DEADLINE_S`` scores 0, is logged, and
is counted in ``rollout/reward_timeouts`` whatever the error policy, and its worker is replaced.

A reward server that still fails after its retries fails the rollout whatever the error policy
(``RemoteRewardError`` names the URL): zeros for a server that is down would train on nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Awaitable, Callable

from miles_async.algorithms import reward_types
from miles_async.config import RewardConfig
from miles_async.rollout.remote_reward import RemoteRewardClient, extract_reward
from miles_async.rollout.sample import Sample
from miles_async.rollout.verifier_pool import VerifierPool, VerifierTimeout
from miles_async.utils.plugins import PluginError, load_function

logger = logging.getLogger(__name__)

RewardFn = Callable[[Sample], "float | Awaitable[float]"]
GroupRewardFn = Callable[[list[Sample]], "list[float] | Awaitable[list[float]]"]


class RewardError(RuntimeError):
    pass


MATH_VERIFY_DEADLINE_S = 10.0


def validate_reward_flags(custom_rm_path: str | None) -> None:
    if custom_rm_path is not None:
        load_function(custom_rm_path, flag="--custom-rm-path")


def resolve_reward_fn(cfg: RewardConfig) -> RewardFn | None:
    """The --custom-rm-path function; None for the built-in types, resolved per sample."""
    if cfg.custom_rm_path is not None:
        return load_function(cfg.custom_rm_path, flag="--custom-rm-path")
    if cfg.rm_type is None:
        raise PluginError("no reward: give --rm-type, --custom-rm-path or --rm-url")
    return None


class RewardModel:
    """Applies the configured reward to samples with the configured error policy."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.group_rm = cfg.group_rm
        self.remote = RemoteRewardClient(cfg.remote, cfg.reward_key) if cfg.remote is not None else None
        self.fn = resolve_reward_fn(cfg) if self.remote is None else None
        self.errors = 0
        self.timeouts = 0
        # Starts a worker only when a sample's type compares with math-verify (a sample's metadata may pick one).
        self._pool = VerifierPool(min(4, os.cpu_count() or 1), MATH_VERIFY_DEADLINE_S, preload=("math_verify",))

    async def score(self, sample: Sample) -> float:
        if self.remote is not None:
            return await self.remote.score(sample)
        try:
            if self.fn is None:
                return await self._score_builtin(sample)
            value = self.fn(sample)
            if inspect.isawaitable(value):
                value = await value
            return extract_reward(value, self.cfg.reward_key)
        except VerifierTimeout as e:
            self.timeouts += 1
            logger.warning(
                "reward of sample uid=%s index=%s scored 0: %s (its worker was replaced)", sample.uid, sample.index, e
            )
            return 0.0
        except Exception as e:
            if self.cfg.on_error == "raise":
                raise RewardError(
                    f"reward function failed on sample uid={sample.uid} index={sample.index}: "
                    f"{e!r} (use --reward-on-error zero to score such samples 0)"
                ) from e
            self.errors += 1
            logger.warning("reward failed on sample uid=%s (scored 0): %r", sample.uid, e)
            return 0.0

    async def _score_builtin(self, sample: Sample) -> float:
        rm_type = reward_types.type_of(sample.metadata, self.cfg.rm_type)
        args = (rm_type, sample.response, sample.label, sample.metadata)
        if reward_types.uses_math_verify(rm_type):
            value = await self._pool.run(reward_types.score, *args)
        else:
            value = reward_types.score(*args)
        return extract_reward(value, self.cfg.reward_key or reward_types.REWARD_KEY)

    async def score_group(self, group: list[Sample]) -> list[float]:
        """--group-rm: one reward per sample of ``group`` (one prompt's samples), from one call."""
        if self.remote is not None:
            return await self.remote.score_group(group)
        try:
            values = self.fn(group)
            if inspect.isawaitable(values):
                values = await values
            if not isinstance(values, (list, tuple)) or len(values) != len(group):
                raise ValueError(
                    f"a --group-rm reward must return one reward per sample ({len(group)}), got {values!r:.200}"
                )
            return [extract_reward(v, self.cfg.reward_key) for v in values]
        except Exception as e:
            uid = group[0].uid if group else None
            if self.cfg.on_error == "raise":
                raise RewardError(
                    f"group reward function failed on the group of uid={uid} ({len(group)} samples): "
                    f"{e!r} (use --reward-on-error zero to score such groups 0)"
                ) from e
            self.errors += len(group)
            logger.warning("group reward failed on uid=%s (its %d samples scored 0): %r", uid, len(group), e)
            return [0.0] * len(group)

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.close()
        if self._pool is not None:
            self._pool.close()
