"""DAPO dynamic sampling for rollouts made on demand (one-step-off and --synchronous).

A rollout draws prompts in rounds of ``--over-sampling-batch-size``, generates and rewards their
groups concurrently, and judges each group with the filter as it finishes; it stops once
``--rollout-batch-size`` groups are kept. Nothing is lost or repeated: a dropped group is consumed
(its prompt is done for the epoch and the audit log names it), and the groups still generating
when the batch is full are cancelled and their prompts given back to the data source, which hands
them out first on the next draw, in the epoch they were drawn in, and saves them in its
checkpoint state. A filter that keeps nothing for a full pass over the data fails the rollout,
naming the filter (``starved_by_filter``), instead of drawing forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.filters import GroupFilter, starvation_message, starved_by_filter
from miles_async.rollout.sample import Sample

logger = logging.getLogger(__name__)

Group = list[Sample]
# Seconds to let cancelled groups unwind (close their requests) before the rollout returns without them.
CANCEL_GRACE_SECONDS = 10.0


class FilterStarvedError(RuntimeError):
    pass


@dataclass(frozen=True)
class DroppedGroup:
    """A group the filter dropped: its prompt is consumed for ``epoch`` without being trained."""

    epoch: int
    uid: str
    rewards: list[float]
    reason: str | None


@dataclass
class DrawReport:
    """What the rollouts since the last ``DynamicSampler.take_report`` drew, beside the groups they return."""

    epochs: list[int] = field(default_factory=list)  # per kept group, in the order returned
    dropped: list[DroppedGroup] = field(default_factory=list)
    given_back: int = 0  # prompts drawn, then handed back to the data source unjudged
    rounds: int = 0  # draws of --over-sampling-batch-size prompts


class DynamicSampler:
    """The round logic, with its counters across rollouts.

    ``group_filter`` None keeps every group (over-sampling alone: the first ``batch_size`` groups to
    finish are trained, the slow tail is cancelled and given back).
    """

    def __init__(self, group_filter: GroupFilter | None, batch_size: int, over_sampling_batch_size: int):
        for name, v in (("batch_size", batch_size), ("over_sampling_batch_size", over_sampling_batch_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DynamicSampler: {name} must be an int >= 1, got {v!r}")
        self.group_filter = group_filter
        self.batch_size = batch_size
        self.over_sampling_batch_size = over_sampling_batch_size
        self.dropped_in_a_row = 0
        self._report = DrawReport()

    def take_report(self) -> DrawReport:
        report, self._report = self._report, DrawReport()
        return report

    async def sample(self, data_source: Any, make_group: Callable[[PromptItem, int], Awaitable[Group]]) -> list[Group]:
        """``batch_size`` kept groups, in the order they finished, renumbered ``group_index`` 0..batch_size-1.

        ``data_source`` has ``draw() -> (epoch, item)``, ``give_back([(epoch, item)])`` and ``items``;
        ``make_group(item, group_index)`` generates and rewards one prompt's group.
        """
        kept: list[tuple[int, Group]] = []
        running: dict[asyncio.Task, tuple[int, PromptItem, int]] = {}
        unjudged: list[tuple[int, PromptItem, int]] = []  # finished after the batch was full
        next_index = 0
        try:
            while len(kept) < self.batch_size:
                # A new round whenever the groups kept and running could no longer fill the batch (slime's rule).
                while len(kept) + len(running) < self.batch_size:
                    self._report.rounds += 1
                    for _ in range(self.over_sampling_batch_size):
                        epoch, item = data_source.draw()
                        task = asyncio.ensure_future(make_group(item, next_index))
                        running[task] = (epoch, item, next_index)
                        next_index += 1
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                # Several can finish at once: judge them in draw order, so a run's choices do not hang on set order.
                for task in sorted(done, key=lambda t: running[t][2]):
                    epoch, item, index = running.pop(task)
                    if len(kept) >= self.batch_size:
                        unjudged.append((epoch, item, index))
                        continue
                    group = task.result()  # a failed group fails the rollout (the rest is given back below)
                    self._judge(data_source, epoch, group, kept)
        finally:
            await _cancel(running)
            back = sorted([*running.values(), *unjudged], key=lambda r: r[2])
            data_source.give_back((epoch, item) for epoch, item, _ in back)
            self._report.given_back += len(back)
        for i, (_, group) in enumerate(kept):
            for s in group:
                s.group_index = i
        self._report.epochs.extend(epoch for epoch, _ in kept)
        return [group for _, group in kept]

    def _judge(self, data_source: Any, epoch: int, group: Group, kept: list[tuple[int, Group]]) -> None:
        decision = self.group_filter(group) if self.group_filter is not None else None
        if decision is None or decision.keep:
            kept.append((epoch, group))
            self.dropped_in_a_row = 0
            return
        rewards = [s.reward for s in group]
        self._report.dropped.append(DroppedGroup(epoch, group[0].uid, rewards, decision.reason))
        self.dropped_in_a_row += 1
        if starved_by_filter(self.dropped_in_a_row, len(data_source.items)):
            raise FilterStarvedError(
                starvation_message(self.group_filter.name, self.dropped_in_a_row, len(data_source.items), rewards)
            )


async def _cancel(running: dict[asyncio.Task, Any]) -> None:
    """Cancel the groups still generating and let them unwind for a bounded time."""
    if not running:
        return
    for task in running:
        task.cancel()
    _, pending = await asyncio.wait(running, timeout=CANCEL_GRACE_SECONDS)
    for task in running:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.debug("a cancelled group ended with %r", task.exception())
    if pending:
        logger.warning("%d cancelled groups did not stop within %.0fs", len(pending), CANCEL_GRACE_SECONDS)
