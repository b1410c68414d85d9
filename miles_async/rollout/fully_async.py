"""The fully-async producer: keeps groups generating across training steps under a staleness bound.

The producer submits a group whenever the staleness manager has capacity; finished groups
are rewarded, filtered and buffered in completion order. ``get_batch`` drains one training
batch, racing the producer task so a producer failure surfaces at once with its traceback,
and logs a watchdog warning when no group finishes for a while.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.dynamic_sampling import DroppedGroup
from miles_async.rollout.filters import BatchAssembler, starvation_message, starved_by_filter
from miles_async.rollout.rollout import RolloutContext, generate_group
from miles_async.rollout.sample import Sample
from miles_async.rollout.staleness import StalenessManager, staleness_of

logger = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    pass


@dataclass(frozen=True)
class _Ticket:
    """The producer's record of one submitted group. It stays off the samples: their metadata
    belongs to the dataset, whatever keys it uses."""

    epoch: int  # the data source's epoch the prompt was drawn in
    item: PromptItem
    submitted_at_step: int


class ProducedBatch(NamedTuple):
    groups: list[list[Sample]]
    epochs: list[int]  # per group, the epoch its prompt was drawn in
    metrics: dict[str, float]


class FullyAsyncProducer:
    def __init__(
        self,
        ctx: RolloutContext,
        data_source: Any,
        staleness: StalenessManager,
        assembler: BatchAssembler,
        watchdog_seconds: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ctx = ctx
        self.data_source = data_source
        self.staleness = staleness
        self.assembler = assembler
        self.watchdog_seconds = watchdog_seconds
        self.timeout = timeout
        self.clock = clock
        self.current_step = 0
        # One event per side: a side clearing its own event can never swallow the other's wake-up.
        self._producer_wake = asyncio.Event()
        self._consumer_wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._group_counter = 0
        self._idle_since: float | None = None
        self._idle_total = 0.0
        self._window_start = clock()
        self.completion_seconds: list[float] = []
        # Groups that finished (or waited) past the staleness bound are not trained; their
        # prompts are generated again so nothing is lost.
        self._retry: deque[_Ticket] = deque()
        # (epoch, uid) of every prompt drawn but not yet trained or filtered.
        self._open: set[tuple[int, str]] = set()
        # Kept groups waiting in the assembler, by their group index (unique to the producer).
        self._buffered: dict[int, _Ticket] = {}
        # (epoch -> uids) trained or filtered: never drawn again in that epoch, also after a resume.
        self.consumed: dict[int, set[str]] = {}
        self.stale_regenerated = 0
        self.last_completion = clock()
        self._dropped: list[DroppedGroup] = []  # filtered since the last batch, for the audit log

    def _notify(self) -> None:
        self._producer_wake.set()
        self._consumer_wake.set()

    # -- producer ----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._produce(), name="fully-async-producer")

    async def _one_group(self, ticket: _Ticket) -> None:
        t0 = self.clock()
        self._group_counter += 1
        group_index = self._group_counter
        group = await generate_group(
            self.ctx, ticket.item, group_index, self.ctx.n_samples_per_prompt, self.ctx.sampling_params
        )
        self.completion_seconds.append(self.clock() - t0)
        self.last_completion = self.clock()
        self.staleness.on_accepted()
        if self._too_stale(group, ticket):
            self._regenerate(ticket)
        elif self.assembler.add(group) == "kept":
            self._buffered[group_index] = ticket
        else:
            self.staleness.on_filtered()
            self._consume(ticket.epoch, ticket.item.uid)
            rewards = [s.reward for s in group]
            self._dropped.append(DroppedGroup(ticket.epoch, ticket.item.uid, rewards, self.assembler.last_reason))
            self._check_filter_not_starving(group)
        self._notify()

    def _ages(self, group: list[Sample], ticket: _Ticket) -> list[int]:
        return [staleness_of(s, self.current_step, ticket.submitted_at_step) for s in group]

    def _too_stale(self, group: list[Sample], ticket: _Ticket) -> bool:
        return max(self._ages(group, ticket)) > self.staleness.max_staleness_steps

    def _check_filter_not_starving(self, group: list[Sample]) -> None:
        in_a_row, prompts = self.assembler.dropped_in_a_row, len(self.data_source.items)
        if starved_by_filter(in_a_row, prompts):
            raise ProducerError(
                starvation_message(self.assembler.filter_name, in_a_row, prompts, [s.reward for s in group])
            )

    def _consume(self, epoch: int, uid: str) -> None:
        self._open.discard((epoch, uid))
        self.consumed.setdefault(epoch, set()).add(uid)

    def _regenerate(self, ticket: _Ticket) -> None:
        self.staleness.on_filtered()
        self._retry.append(ticket)
        self.stale_regenerated += 1

    def _draw(self) -> _Ticket:
        if self._retry:
            old = self._retry.popleft()
            return _Ticket(old.epoch, old.item, self.current_step)
        while True:
            item = self.data_source.next_item()
            epoch = self.data_source.epoch
            if item.uid not in self.consumed.get(epoch, ()) and (epoch, item.uid) not in self._open:
                self._open.add((epoch, item.uid))
                return _Ticket(epoch, item, self.current_step)

    async def _produce(self) -> None:
        in_flight: set[asyncio.Task] = set()
        try:
            while True:
                while self.staleness.try_submit():
                    if self._idle_since is not None:
                        self._idle_total += self.clock() - self._idle_since
                        self._idle_since = None
                    in_flight.add(asyncio.create_task(self._one_group(self._draw())))
                if not in_flight and self._idle_since is None:
                    self._idle_since = self.clock()  # generation idle: the staleness bound holds it back
                wake = asyncio.create_task(self._producer_wake.wait())
                done, _ = await asyncio.wait(in_flight | {wake}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                self._producer_wake.clear()
                for t in done - {wake}:
                    in_flight.discard(t)
                    t.result()  # a failed group kills the producer; get_batch re-raises it
        finally:
            for t in in_flight:
                t.cancel()

    def on_step(self, step: int) -> None:
        """Training finished ``step`` steps (and the engines hold those weights): more capacity."""
        self.current_step = step
        self.staleness.on_step(step)
        for group in self.assembler.evict(lambda g: self._too_stale(g, self._buffered[g[0].group_index])):
            self._regenerate(self._buffered.pop(group[0].group_index))
        self._notify()

    # -- consumer ----------------------------------------------------------------------
    async def get_batch(self) -> ProducedBatch:
        self.start()
        buffered_at_start = self.assembler.num_ready()
        t_start = self.clock()
        while True:
            self._consumer_wake.clear()  # before the check, so no wake-up between the two is lost
            if self.assembler.ready():
                break
            if self._task.done():
                exc = self._task.exception() if not self._task.cancelled() else None
                raise ProducerError(f"the fully-async producer stopped: {exc!r}") from exc
            waiter = asyncio.create_task(self._consumer_wake.wait())
            done, _ = await asyncio.wait(
                {waiter, self._task}, timeout=self.watchdog_seconds, return_when=asyncio.FIRST_COMPLETED
            )
            if not waiter.done():
                waiter.cancel()
            if not done:
                stalled = self.clock() - self.last_completion
                logger.warning(
                    "watchdog: no group finished for %.0fs (running %d, buffered %d)",
                    stalled,
                    self.staleness.running,
                    self.assembler.num_ready(),
                )
                if self.clock() - t_start > self.timeout:
                    raise ProducerError(f"no training batch after {self.timeout:.0f}s (--rollout-timeout)")
        groups = self.assembler.take()
        tickets = [self._buffered.pop(g[0].group_index) for g in groups]
        for t in tickets:  # handed to the trainer: consumed for this epoch
            self._consume(t.epoch, t.item.uid)
        self._notify()  # taking a batch may free capacity
        metrics = self._metrics(groups, tickets, buffered_at_start, self.clock() - t_start)
        return ProducedBatch(groups, [t.epoch for t in tickets], metrics)

    def take_dropped(self) -> list[DroppedGroup]:
        """The groups the filter dropped since the last call (their prompts are consumed), for the audit log."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _metrics(
        self, groups: list[list[Sample]], tickets: list[_Ticket], buffered: int, waited: float
    ) -> dict[str, float]:
        ages = [age for g, t in zip(groups, tickets) for age in self._ages(g, t)]
        now = self.clock()
        window = max(now - self._window_start, 1e-9)
        idle = self._idle_total + (now - self._idle_since if self._idle_since is not None else 0.0)
        times = sorted(self.completion_seconds) or [0.0]
        metrics = {
            "async/staleness_min": min(ages),
            "async/staleness_mean": statistics.fmean(ages),
            "async/staleness_max": max(ages),
            "async/buffer_at_wait_start": buffered,
            "async/wait_seconds": waited,
            "async/producer_idle_frac": min(1.0, idle / window),
            "async/groups_kept": self.assembler.kept,
            "async/groups_dropped": self.assembler.dropped,
            "async/group_seconds_mean": statistics.fmean(times),
            "async/group_seconds_p90": times[int(0.9 * (len(times) - 1))],
            "async/running_groups": self.staleness.running,
            "async/stale_regenerated": self.stale_regenerated,
        }
        self._window_start, self._idle_total = now, 0.0
        if self._idle_since is not None:
            self._idle_since = now
        self.completion_seconds.clear()
        return metrics

    # -- resume ------------------------------------------------------------------------
    def state_dict(self, trained_steps: int) -> dict:
        """Consumed uids of every epoch that still has prompts to give; in-flight and buffered
        groups are not saved: a resumed run draws their prompts again."""
        oldest = min([self.data_source.epoch, *(e for e, _ in self._open)])  # _open includes the retries
        return {
            "epoch": oldest,
            "step": trained_steps,
            "consumed": {str(e): sorted(u) for e, u in self.consumed.items() if e >= oldest},
        }

    def load_state_dict(self, state: dict) -> None:
        self.consumed = {int(e): set(u) for e, u in state["consumed"].items()}
        self.data_source.load_state_dict(
            {"epoch": state["epoch"], "offset": 0, "num_items": len(self.data_source.items)}
        )
        self.current_step = int(state["step"])
        self.staleness.resume_at_step(self.current_step)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
