"""What the control API knows of the loop and asks of it: pure, synchronous, with an injected clock.

The loop reports its phase and each finished step; the API's commands (save, stop, pause) become flags that
the loop takes at its step boundary. Nothing here waits or does I/O: ``control.Control`` adds that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# One of these is current at any time; the Prometheus phase gauge has one series per phase, 1 for the current one.
PHASES = ("starting", "generating", "training", "saving", "updating_weights", "evaluating", "paused")


class CommandRefused(Exception):
    """A command this run cannot carry out (``POST /save`` without --save); the API answers 409 with it."""


@dataclass(frozen=True)
class StepCommands:
    """What the loop must do at a step boundary: save after this step, then end the run."""

    save: bool
    stop: bool


def step_gauges(metrics: Mapping[str, float]) -> dict[str, float]:
    """The gauges a finished step's metrics (the dict the loop logs) give; a gauge whose keys are missing
    (e.g. staleness without --fully-async) is left out rather than reported as 0."""
    out: dict[str, float] = {}
    seconds = metrics.get("time/step_seconds")
    if seconds is not None:
        out["step_seconds"] = float(seconds)
        samples, length = metrics.get("rollout/num_samples"), metrics.get("rollout/response_len_mean")
        if samples is not None and length is not None and seconds > 0:
            out["tokens_per_second"] = float(samples) * float(length) / seconds
    for gauge, key in (
        ("buffer_groups", "async/buffer_at_wait_start"),
        ("staleness_mean", "async/staleness_mean"),
        ("staleness_max", "async/staleness_max"),
    ):
        if key in metrics:
            out[gauge] = float(metrics[key])
    # Over the run so far, in both loops (the dynamic-sampling filter's totals).
    kept, dropped = metrics.get("rollout/groups_kept_total"), metrics.get("rollout/groups_dropped_total")
    if kept is not None and dropped is not None and kept + dropped > 0:
        out["keep_rate"] = float(kept) / (kept + dropped)
    return out


class ControlState:
    def __init__(self, clock: Callable[[], float], can_save: bool, start_step: int = 0):
        """``can_save``: the run has --save (else /save is refused). ``start_step``: steps done before this
        process (a run resumed from --load)."""
        self.clock = clock
        self.can_save = can_save
        self.phase = "starting"
        self.phase_since = clock()
        self.step = start_step
        self.gauges: dict[str, float] = {}
        self.paused = False
        self.save_requested = False
        self.stop_requested = False

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        if phase != self.phase:
            self.phase, self.phase_since = phase, self.clock()

    def step_done(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step ``step`` (rollouts done, as metrics.jsonl counts them) finished with these metrics. Gauges keep
        their last known value when a step lacks them (a step without the async keys)."""
        self.step = step
        self.gauges.update(step_gauges(metrics))

    # -- commands ------------------------------------------------------------------------------
    def request_save(self) -> None:
        if not self.can_save:
            raise CommandRefused("POST /save needs --save: this run has no checkpoint folder to save to")
        self.save_requested = True

    def request_stop(self) -> None:
        self.stop_requested = True

    def take_commands(self) -> StepCommands:
        """At the step boundary: the commands to honour now. A save request is consumed; a stop request stays
        (the run is ending) and implies a save when the run can save."""
        save = self.save_requested or (self.stop_requested and self.can_save)
        self.save_requested = False
        return StepCommands(save=save, stop=self.stop_requested)

    def snapshot(self) -> dict:
        """The loop's side of GET /status."""
        return {
            "step": self.step,
            "phase": self.phase,
            "phase_seconds": self.clock() - self.phase_since,
            "paused": self.paused,
            "save_requested": self.save_requested,
            "stop_requested": self.stop_requested,
            **{k: self.gauges.get(k) for k in GAUGES},
        }


# The step gauges, in the order /status and /metrics show them.
GAUGES = ("step_seconds", "tokens_per_second", "buffer_groups", "keep_rate", "staleness_mean", "staleness_max")
