"""Fault tolerance for the training workers: who died, whether the run may go on, and from where.

Pure policy, as ``inference/fault_tolerance.py`` is for the engines: no Ray, no files. ``ray/train_group.py``
notices a death (a cheap liveness watch on every worker, raced against whatever the driver awaits) and raises
``TrainerDied``; ``Run.recover_trainers`` (run.py) asks ``TrainerRecovery.on_death`` what to do and does it.

Without --use-fault-tolerance the answer is always ``TrainerFailed``: the run ends, naming the worker. With it,
every training group (the actor and, for PPO, the critic: both must stand at the same step) is rebuilt from the
``RestorePoint`` (the last complete checkpoint, else where the run itself started: its --load or the initial
model), and the rollout executor rewinds with them to the same checkpoint's data position, so no prompt is lost
or trained twice. The loop then goes on from the restore point's next rollout. At most --max-trainer-restarts
such restarts over the run; the next death ends it, naming that count.
"""

from __future__ import annotations

from dataclasses import dataclass


class TrainerDied(RuntimeError):
    """A training worker's process is gone (killed, crashed, its node lost)."""

    def __init__(self, role: str, rank: int, pid: int | None, node: str | None, cause: str):
        self.role, self.rank, self.pid, self.node, self.cause = role, rank, pid, node, cause.rstrip(". ")
        super().__init__(f"training worker {role} rank {rank} (pid {pid}, node {node}) died: {self.cause}")


class TrainerFailed(RuntimeError):
    """A training worker died and the run may not restart it: the run stops."""


@dataclass(frozen=True)
class RestorePoint:
    """What the training workers and the data source are rebuilt from: checkpoint ``rollout_id`` in ``load_dir``,
    or with ``load_dir`` None the initial model (--hf-checkpoint) and the data source's first position."""

    load_dir: str | None = None
    rollout_id: int | None = None

    @property
    def start(self) -> int:
        """The first rollout the loop trains after restoring."""
        return 0 if self.rollout_id is None else self.rollout_id + 1

    def describe(self) -> str:
        if self.load_dir is None:
            return "the initial model (no checkpoint saved yet)"
        return f"checkpoint {self.rollout_id} in {self.load_dir}"


class TrainerRecovery:
    """The restart budget and the restore point.

    ``max_restarts`` None: no fault tolerance (a death ends the run). ``save_dir``: where the run's checkpoints go
    (--save). ``initial``: where the run itself started (its --load checkpoint, or the initial model).
    """

    def __init__(self, max_restarts: int | None, save_dir: str | None, initial: RestorePoint = RestorePoint()):
        self.max_restarts = max_restarts
        self.save_dir = save_dir
        self.initial = initial
        self.restarts = 0

    def on_death(self, death: TrainerDied, latest_saved: int | None) -> RestorePoint:
        """A worker died; ``latest_saved``: the last complete checkpoint in ``save_dir`` (None: none). Returns where
        to restore from and counts the restart, or raises ``TrainerFailed`` saying why the run stops."""
        if self.max_restarts is None:
            raise TrainerFailed(
                f"{death}; the run stops (--use-fault-tolerance would rebuild the training workers from the last "
                f"checkpoint and go on)"
            )
        if self.restarts >= self.max_restarts:
            raise TrainerFailed(
                f"{death}; the run stops: {self.restarts} trainer restart(s) already used of "
                f"--max-trainer-restarts {self.max_restarts}"
            )
        self.restarts += 1
        return self.restore_point(latest_saved)

    def restore_point(self, latest_saved: int | None) -> RestorePoint:
        """The newest of the run's own last checkpoint and its starting point. A checkpoint in ``save_dir`` older
        than where the run started (a --save folder holding an earlier run's iterations) is not this run's."""
        if self.save_dir is None or latest_saved is None:
            return self.initial
        if self.initial.rollout_id is not None and latest_saved < self.initial.rollout_id:
            return self.initial
        return RestorePoint(self.save_dir, latest_saved)
