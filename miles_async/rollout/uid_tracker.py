"""Which prompts an epoch has already used, so a resumed run never trains on a prompt twice.

Both trained and filtered uids are "consumed": a filtered prompt was generated and judged
useless (e.g. zero reward variance), and regenerating it after a restart would only waste
compute and shift which prompts get trained.
"""

from __future__ import annotations

from typing import Any, Iterable

_STATE_FORMAT = 1


class ConsumedUids:
    """Per-epoch record of trained and filtered prompt uids, in the order they were recorded."""

    def __init__(self, epoch: int = 0):
        self._check_epoch(epoch)
        self.epoch = epoch
        # dicts as insertion-ordered sets: the order is what a reader of a checkpoint wants to see.
        self._trained: dict[str, None] = {}
        self._filtered: dict[str, None] = {}

    @staticmethod
    def _check_epoch(epoch: Any) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"ConsumedUids: epoch must be an int >= 0, got {epoch!r}")

    def should_skip(self, uid: str) -> bool:
        return uid in self._trained or uid in self._filtered

    def _mark(self, uids: Iterable[str], into: dict[str, None], what: str) -> None:
        batch = list(uids)
        seen: set[str] = set()
        for uid in batch:
            if not isinstance(uid, str):
                raise ValueError(f"ConsumedUids.mark_{what}: uids must be strings, got {uid!r}")
            if uid in seen or self.should_skip(uid):
                prior = ("twice in this call" if uid in seen
                         else "already trained" if uid in self._trained else "already filtered")
                raise ValueError(f"ConsumedUids.mark_{what}: uid {uid!r} {prior} in epoch {self.epoch}; "
                                 "a prompt may be used at most once per epoch")
            seen.add(uid)
        # Validated first, so a rejected call records nothing.
        into.update(dict.fromkeys(batch))

    def mark_trained(self, uids: Iterable[str]) -> None:
        self._mark(uids, self._trained, "trained")

    def mark_filtered(self, uids: Iterable[str]) -> None:
        self._mark(uids, self._filtered, "filtered")

    def new_epoch(self, epoch: int) -> None:
        """Start ``epoch`` with nothing consumed; epochs only move forward."""
        self._check_epoch(epoch)
        if epoch <= self.epoch:
            # Restarting the current epoch would clear its records and retrain its prompts.
            raise ValueError(f"ConsumedUids.new_epoch: epoch {epoch} does not follow epoch {self.epoch}")
        self.epoch = epoch
        self._trained.clear()
        self._filtered.clear()

    @property
    def num_trained(self) -> int:
        return len(self._trained)

    @property
    def num_filtered(self) -> int:
        return len(self._filtered)

    def trained_uids(self) -> list[str]:
        return list(self._trained)

    def filtered_uids(self) -> list[str]:
        return list(self._filtered)

    def state_dict(self) -> dict[str, Any]:
        return {"format": _STATE_FORMAT, "epoch": self.epoch, "trained": list(self._trained),
                "filtered": list(self._filtered)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "trained", "filtered"} - set(state)
        if missing:
            raise ValueError(f"ConsumedUids.load_state_dict: missing keys {sorted(missing)}")
        if state.get("format", _STATE_FORMAT) != _STATE_FORMAT:
            raise ValueError(f"ConsumedUids.load_state_dict: unknown format {state.get('format')!r}")
        self._check_epoch(state["epoch"])
        fresh = ConsumedUids(state["epoch"])
        for key in ("trained", "filtered"):
            if not isinstance(state[key], list):
                raise ValueError(f"ConsumedUids.load_state_dict: {key} must be a list, got "
                                 f"{type(state[key]).__name__}")
        # Replaying through the marking path applies the same duplicate checks to the checkpoint.
        fresh.mark_trained(state["trained"])
        fresh.mark_filtered(state["filtered"])
        self.epoch, self._trained, self._filtered = fresh.epoch, fresh._trained, fresh._filtered
