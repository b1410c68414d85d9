"""Group filters (DAPO dynamic sampling) and batch assembly for fully-async training.

A group whose samples all got the same reward has zero group-relative advantage: training on
it costs a step's compute and moves nothing. A dynamic-sampling filter
(``--dynamic-sampling-filter-path``, or the built-in ``zero_variance`` with
``--zero-variance-filter``) drops such groups and the rollout keeps drawing prompts until a full
batch is kept. In fully-async mode the caller gives a dropped group's capacity back
(``StalenessManager.on_filtered``) so the producer replaces it instead of the step waiting
forever for groups that will never come.

A filter has Miles/slime's signature, ``fn(args, samples, **kwargs)`` with ``samples`` the
rewarded samples of one prompt, and returns a bool or an object with ``.keep`` (and optionally
``.reason``), e.g. ``DynamicFilterOutput``; a Miles user's filter loads by its dotted path.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

from miles_async.config.rollout import RolloutConfig
from miles_async.rollout.sample import Sample, SampleStatus
from miles_async.utils.plugins import load_function

Group = list[Sample]

DYNAMIC_FILTER_FLAG = "--dynamic-sampling-filter-path"


@dataclass(frozen=True)
class DynamicFilterOutput:
    """A filter's verdict on one group (Miles/slime's shape): keep it or not, and why not."""

    keep: bool
    reason: str | None = None


def zero_variance_groups(rewards_per_group: list[list[float]], tol: float) -> list[bool]:
    """Per group, True when every reward lies within ``tol`` of every other (max - min <= tol).

    A group of zero or one reward is trivially zero-variance; whether to drop it is the
    caller's decision (``zero_variance`` and ``BatchAssembler`` keep singletons).
    """
    if not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"zero_variance_groups: tol must be a finite number >= 0, got {tol!r}")
    flags = []
    for i, rewards in enumerate(rewards_per_group):
        for r in rewards:
            # NaN compares false with everything, so it would make a group look informative.
            if not math.isfinite(r):
                raise ValueError(f"zero_variance_groups: group {i} has a non-finite reward {r!r}")
        flags.append(not rewards or max(rewards) - min(rewards) <= tol)
    return flags


def zero_variance(args: Any, samples: Group, **kwargs: Any) -> DynamicFilterOutput:
    """The built-in dynamic-sampling filter (``--zero-variance-filter``): drop a group whose rewards all lie
    within ``args.zero_variance_tol`` (``--zero-variance-tol``) of each other.

    A singleton is kept: with one sample per prompt there is no group baseline to vary around,
    and dropping every group would never fill a batch.
    """
    rewards = [float(s.reward) for s in samples]
    if len(rewards) <= 1 or not zero_variance_groups([rewards], getattr(args, "zero_variance_tol", 0.0))[0]:
        return DynamicFilterOutput(True)
    return DynamicFilterOutput(False, f"zero_std_{round(rewards[0], 1)}")


def no_aborted(args: Any, samples: Group, **kwargs: Any) -> DynamicFilterOutput:
    """Miles' ``check_no_aborted``: drop a group in which any sample was aborted (an environment's timeout, a
    crashed sandbox), so that no group trains on a cut-off trajectory."""
    if any(s.status == SampleStatus.ABORTED for s in samples):
        return DynamicFilterOutput(False, "group_has_aborted")
    return DynamicFilterOutput(True)


@dataclass(frozen=True)
class GroupFilter:
    """A loaded dynamic-sampling filter, called as ``filter(group) -> DynamicFilterOutput``.

    ``name`` says in messages where it came from (``--zero-variance-filter``, or
    ``--dynamic-sampling-filter-path pkg.mod:fn``).
    """

    fn: Callable[..., Any]
    args: Any
    name: str

    def __call__(self, group: Group) -> DynamicFilterOutput:
        out = self.fn(self.args, group)
        if inspect.isawaitable(out):
            raise TypeError(f"{self.name}: the filter must be a plain function, it returned an awaitable")
        return verdict(out, self.name)


def verdict(out: Any, name: str = DYNAMIC_FILTER_FLAG) -> DynamicFilterOutput:
    """A filter's return value as a ``DynamicFilterOutput``: a bool (numpy's and a 0-d tensor's too) or an
    object with ``.keep`` and optionally ``.reason``; anything else is refused, naming the filter."""
    keep = getattr(out, "keep", out)
    reason = getattr(out, "reason", None)
    if keep is None or isinstance(keep, (str, bytes, list, tuple, dict, set)):
        raise TypeError(
            f"{name}: a filter returns a bool or an object with .keep (e.g. DynamicFilterOutput), got {out!r}"
        )
    try:
        keep = bool(keep)  # a torch / numpy scalar (Miles' check_reward_nonzero_std returns a tensor)
    except Exception as e:
        raise TypeError(f"{name}: the filter's keep value {keep!r} is not a single truth value: {e}") from e
    return DynamicFilterOutput(keep, None if keep else (str(reason) if reason is not None else "filtered"))


def filter_args(cfg: RolloutConfig) -> SimpleNamespace:
    """The ``args`` a filter receives: the run's rollout settings under their flag names (Miles/slime hand their
    argparse namespace; a filter reads what it needs, e.g. ``args.zero_variance_tol``)."""
    ds = cfg.dynamic_sampling
    return SimpleNamespace(
        rollout_batch_size=cfg.rollout_batch_size,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        over_sampling_batch_size=ds.over_sampling_batch_size if ds else cfg.rollout_batch_size,
        dynamic_sampling_filter_path=ds.filter_path if ds else None,
        zero_variance_tol=ds.zero_variance_tol if ds else 0.0,
        reward_key=cfg.reward.reward_key,
    )


def load_group_filter(path: str, args: Any, name: str | None = None) -> GroupFilter:
    """The filter at dotted ``path`` (``pkg.mod:fn`` or ``pkg.mod.fn``); errors name
    ``--dynamic-sampling-filter-path``."""
    return GroupFilter(load_function(path, DYNAMIC_FILTER_FLAG), args, name or f"{DYNAMIC_FILTER_FLAG} {path}")


class BatchAssembler:
    """Collects finished groups, in completion order, until a training batch of kept groups exists.

    ``add`` classifies each group as ``"kept"`` or ``"dropped"``; a dropped group is gone and
    the caller accounts for it (``on_filtered``, mark its uid filtered). ``take`` hands out the
    oldest ``batch_size`` kept groups. Counters ``kept``/``dropped`` are cumulative;
    ``dropped_in_a_row`` counts the drops since the last kept group; ``last_reason`` is why the
    last dropped group was dropped.
    """

    def __init__(self, batch_size: int, tol: float | None = 0.0, group_filter: GroupFilter | None = None):
        """``group_filter`` decides each group (``--dynamic-sampling-filter-path``); without one, ``tol`` is the
        built-in zero-variance rule's tolerance and ``None`` turns filtering off (every group kept)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"BatchAssembler: batch_size must be an int >= 1, got {batch_size!r}")
        if tol is not None and not (tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"BatchAssembler: tol must be None or a finite number >= 0, got {tol!r}")
        self.batch_size = batch_size
        self.tol = tol
        self.group_filter = group_filter
        self._ready: deque[Group] = deque()
        self.kept = 0
        self.dropped = 0
        self.dropped_in_a_row = 0
        self.last_reason: str | None = None

    @property
    def filter_name(self) -> str:
        return self.group_filter.name if self.group_filter is not None else "--zero-variance-filter"

    def _keep(self, group: Group, rewards: list[float]) -> DynamicFilterOutput:
        if self.group_filter is not None:
            return self.group_filter(group)
        # A singleton has no group baseline to vary around; with one sample per prompt a
        # "filter" would drop every group and training would never get a batch.
        if self.tol is not None and len(group) > 1 and zero_variance_groups([rewards], self.tol)[0]:
            return DynamicFilterOutput(False, f"zero_std_{round(rewards[0], 1)}")
        return DynamicFilterOutput(True)

    @staticmethod
    def _validate(group: Group) -> list[float]:
        if not group:
            raise ValueError("BatchAssembler.add: empty group")
        uids = {s.uid for s in group}
        if len(uids) != 1:
            raise ValueError(f"BatchAssembler.add: a group must share one uid, got {sorted(uids)}")
        missing = [s.index for s in group if s.reward is None]
        if missing:
            raise ValueError(
                f"BatchAssembler.add: group {group[0].uid!r} has unscored samples "
                f"(indices {missing}); reward it before adding"
            )
        return [float(s.reward) for s in group]

    def add(self, group: Group) -> Literal["kept", "dropped"]:
        rewards = self._validate(group)
        decision = self._keep(group, rewards)
        if not decision.keep:
            self.dropped += 1
            self.dropped_in_a_row += 1
            self.last_reason = decision.reason
            return "dropped"
        self._ready.append(group)
        self.kept += 1
        self.dropped_in_a_row = 0
        return "kept"

    def num_ready(self) -> int:
        """Kept groups buffered and not yet taken."""
        return len(self._ready)

    def ready(self) -> bool:
        return len(self._ready) >= self.batch_size

    def take(self) -> list[Group]:
        """Exactly ``batch_size`` kept groups, oldest completion first."""
        if not self.ready():
            raise RuntimeError(f"BatchAssembler.take: {len(self._ready)} kept groups, need {self.batch_size}")
        return [self._ready.popleft() for _ in range(self.batch_size)]

    def evict(self, predicate: Callable[[Group], bool]) -> list[Group]:
        """Remove and return the buffered groups for which ``predicate`` holds, keeping order.

        Meant for groups that became too stale to train once a step finished; the caller gives
        their capacity back (``on_filtered``) and may regenerate their prompts.
        """
        out = [g for g in self._ready if predicate(g)]
        if out:
            self._ready = deque(g for g in self._ready if not predicate(g))
        return out


# Drops in a row that chance alone cannot explain: even a reward that leaves 70% of groups without
# variance drops 64 in a row with probability 0.7**64 ~ 1e-10. Small data sets would otherwise trip the
# rule by chance (6 prompts at 30% zero-variance groups: 0.3**6 ~ 7e-4 per window).
MIN_DROPS_IN_A_ROW = 64


def starved_by_filter(dropped_in_a_row: int, num_prompts: int) -> bool:
    """Whether the zero-variance filter has dropped, in a row, as many groups as the data has prompts
    (and at least ``MIN_DROPS_IN_A_ROW``).

    Nothing kept over a full pass's worth of groups means the reward gives every sample of a
    group the same value (a broken verifier, a label key that matches nothing, a task already
    mastered): waiting for a batch would only burn compute until ``--rollout-timeout``. The
    bound grows with the data, so a dataset whose informative prompts are rare is not stopped
    early, and it never costs more generation than one epoch.
    """
    return dropped_in_a_row >= max(num_prompts, MIN_DROPS_IN_A_ROW)


def starvation_message(filter_name: str, dropped_in_a_row: int, num_prompts: int, last_rewards: list) -> str:
    """Why a run whose filter keeps nothing stops (``starved_by_filter``), naming the filter."""
    return (
        f"{filter_name} dropped {dropped_in_a_row} groups in a row, at least a full pass over the {num_prompts} "
        f"prompts of the data: no group passes it (the last group's rewards: {last_rewards}), so no batch can be "
        f"trained. Check the reward (--rm-type, --custom-rm-path, --label-key) and the filter, or run without it."
    )
