"""Group filtering and batch assembly for fully-async training.

A group whose samples all got the same reward has zero group-relative advantage: training on
it costs a step's compute and moves nothing. Such groups are dropped, and the caller gives their
capacity back (``StalenessManager.on_filtered``) so the producer replaces them instead of the
step waiting forever for groups that will never come.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Literal

from miles_async.rollout.sample import Sample

Group = list[Sample]


def zero_variance_groups(rewards_per_group: list[list[float]], tol: float) -> list[bool]:
    """Per group, True when every reward lies within ``tol`` of every other (max - min <= tol).

    A group of zero or one reward is trivially zero-variance; whether to drop it is the
    caller's decision (``BatchAssembler`` keeps singletons).
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


class BatchAssembler:
    """Collects finished groups, in completion order, until a training batch of kept groups exists.

    ``add`` classifies each group as ``"kept"`` or ``"dropped"``; a dropped group is gone and
    the caller accounts for it (``on_filtered``, mark its uid filtered). ``take`` hands out the
    oldest ``batch_size`` kept groups. Counters ``kept``/``dropped`` are cumulative;
    ``dropped_in_a_row`` counts the drops since the last kept group.
    """

    def __init__(self, batch_size: int, tol: float | None = 0.0):
        """``tol`` is the zero-variance tolerance; ``None`` turns the filter off (every group kept)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"BatchAssembler: batch_size must be an int >= 1, got {batch_size!r}")
        if tol is not None and not (tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"BatchAssembler: tol must be None or a finite number >= 0, got {tol!r}")
        self.batch_size = batch_size
        self.tol = tol
        self._ready: deque[Group] = deque()
        self.kept = 0
        self.dropped = 0
        self.dropped_in_a_row = 0

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
        # A singleton has no group baseline to vary around; with one sample per prompt a
        # "filter" would drop every group and training would never get a batch.
        if self.tol is not None and len(group) > 1 and zero_variance_groups([rewards], self.tol)[0]:
            self.dropped += 1
            self.dropped_in_a_row += 1
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
