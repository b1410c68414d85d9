"""Small helpers shared by the loop and the components."""

from __future__ import annotations


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None, num_rollout: int
) -> bool:
    """True after every ``interval``-th rollout, at the end of each epoch and after the last rollout."""
    if interval is None:
        return False
    step = rollout_id + 1
    if step % interval == 0 or step == num_rollout:
        return True
    return bool(num_rollout_per_epoch) and step % num_rollout_per_epoch == 0
