"""Checkpoint layout and atomic writes.

``<save>/iter_<rollout_id>/`` holds the parts each component writes (policy, optimizer,
RNG, data-source state). The pointer ``latest_checkpointed_iteration.txt`` is written
last, by the loop, only after every part finished, and atomically (write to a temp file,
fsync, rename): a crash mid-save leaves the previous checkpoint marked as latest.
"""

from __future__ import annotations

import json
import os
import tempfile
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
