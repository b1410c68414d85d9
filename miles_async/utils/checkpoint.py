"""Checkpoint layout and atomic writes.

``<save>/iter_<rollout_id>/`` holds the parts each component writes (policy, optimizer,
RNG, data-source state). The pointer ``latest_checkpointed_iteration.txt`` is written
last, by the loop, only after every part finished, and atomically (write to a temp file,
fsync, rename): a crash mid-save leaves the previous checkpoint marked as latest. With
--async-save the parts are copied at the step boundary and written while training goes on
(``BackgroundSave``); the pointer still moves only once every part is on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

POINTER = "latest_checkpointed_iteration.txt"


def iteration_dir(save_dir: str | os.PathLike, rollout_id: int) -> Path:
    return Path(save_dir) / f"iter_{rollout_id:07d}"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def fsync_path(path: str | os.PathLike) -> None:
    """Flushes a written file, or a folder's entries, to disk: a part of a checkpoint is durable before the
    pointer names it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def mark_complete(save_dir: str | os.PathLike, rollout_id: int) -> None:
    marker = iteration_dir(save_dir, rollout_id) / "COMPLETE"
    atomic_write_bytes(marker, b"")
    atomic_write_bytes(Path(save_dir) / POINTER, f"{rollout_id}\n".encode())


def latest_checkpointed_iteration(save_dir: str | os.PathLike) -> int | None:
    pointer = Path(save_dir) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    try:
        rollout_id = int(text)
    except ValueError as e:
        raise ValueError(f"--load: {pointer} does not hold an iteration number: {text!r}") from e
    if not (iteration_dir(save_dir, rollout_id) / "COMPLETE").is_file():
        raise ValueError(f"--load: {pointer} points at iteration {rollout_id}, whose folder is incomplete")
    return rollout_id


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a file of one is refused on --load."""


def load_tensors(path: str | os.PathLike) -> Any:
    """A ``torch.save`` part of a checkpoint (optimizer, RNG), read with ``weights_only=True``: tensors and plain
    containers only, so a tampered pickle in a checkpoint folder is refused instead of run."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"--load: {path} is refused: it holds more than tensors and plain values (torch.load weights_only), "
            f"so it was tampered with or written by an older miles-async (save it again with this one): {e}"
        ) from e


class BackgroundSave:
    """The loop's view of the checkpoint being written while training goes on: at most one, and its failure
    reported at the next step or save boundary naming its folder."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._folder: Path | None = None

    def start(self, write: Awaitable[None], folder: Path) -> None:
        if self._task is not None:
            raise RuntimeError(f"a checkpoint ({self._folder}) is still being written; wait() for it first")
        self._task, self._folder = asyncio.ensure_future(write), folder

    @property
    def in_flight(self) -> Path | None:
        """The folder being written, if any."""
        return self._folder if self._task is not None and not self._task.done() else None

    def check(self) -> None:
        """Raises if the last background save failed (and forgets it); returns at once otherwise."""
        if self._task is not None and self._task.done():
            self._reap()

    async def wait(self) -> None:
        """Until the save in flight, if any, is written and marked complete; raises naming its folder if it failed.
        No timeout of its own: the write is a call to the workers, which fails when one of them dies."""
        if self._task is not None:
            await asyncio.wait([self._task])
            self._reap()

    def abandon(self) -> None:
        """Stops waiting for the save in flight (its writers are gone): its folder stays without COMPLETE."""
        if self._task is not None:
            self._task.cancel()
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._task = self._folder = None

    def _reap(self) -> None:
        task, folder, self._task, self._folder = self._task, self._folder, None, None
        if task.cancelled():
            raise CheckpointError(f"the background save of {folder} was cancelled; the folder is incomplete")
        error = task.exception()
        if error is not None:
            # A worker's error comes with its remote traceback; its last line is the error itself.
            detail = (str(error).strip().splitlines() or [type(error).__name__])[-1]
            raise CheckpointError(f"the background save of {folder} failed: {detail}") from error
