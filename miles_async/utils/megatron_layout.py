"""Megatron-LM's checkpoint folder layout, as its ``save_checkpoint`` and Miles' and slime's converters write it.

A checkpoint folder holds the tracker ``latest_checkpointed_iteration.txt`` (written last) and the folder it
names: ``iter_NNNNNNN/`` for a number, ``release/`` for ``release`` (Miles' ``convert_hf_to_torch_dist.py``
writes the latter). A torch_dist folder is what ``megatron.core.dist_checkpointing.save`` writes: its
``metadata.json``, the tensors' ``.distcp`` files and the common state (``common.pt``).

What a ``--load`` folder holds decides the run (``load_state``): nothing (or no folder at all) is a fresh
start, as in Megatron-LM and Miles, so one launcher line serves the first start and every requeue; a tracker
naming a complete iteration is a resume; a partial save (a tracker without its folder, or iteration folders
without the tracker) is refused, naming what is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
DIST_METADATA = "metadata.json"  # megatron.core.dist_checkpointing's marker of a saved folder
COMPLETE = "COMPLETE"  # our saves' marker: every part of the iteration is on disk (utils/checkpoint.py)


class LayoutError(ValueError):
    """A checkpoint folder that is neither empty nor complete; the message names what is missing."""


def iteration_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def read_tracker(folder: Path) -> int | str | None:
    """The tracker's iteration number, or ``release``; None without a tracker."""
    tracker = folder / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise LayoutError(f"{tracker} holds {text!r}, neither an iteration number nor 'release'") from None


def saved_folders(folder: Path) -> list[str]:
    """The ``iter_*`` and ``release`` folders in ``folder``, by name."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and (p.name == RELEASE or p.name.startswith("iter_")))


def looks_like_megatron(folder: Path) -> bool:
    """Any trace of Megatron-LM's layout: a tracker, an iteration folder or a bare torch_dist folder."""
    return (folder / TRACKER).is_file() or (folder / ".metadata").is_file() or bool(saved_folders(folder))


def _missing_tracker(folder: Path, found: list[str]) -> str:
    return (
        f"{folder} holds {', '.join(f'{f}/' for f in found)} but no {TRACKER}, which Megatron-LM writes last "
        f"to name the iteration to load: a save that did not finish, or a copy that left the tracker behind "
        f"(write the iteration number, or 'release', into {TRACKER}; or empty the folder to start afresh)"
    )


def torch_dist_folder(path: str | os.PathLike) -> Path:
    """The torch_dist folder a Megatron-LM checkpoint's tracker names; ``LayoutError`` naming what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise LayoutError(f"not a folder: {folder}")
    tracker = read_tracker(folder)
    if tracker is None:
        found = saved_folders(folder)
        raise LayoutError(_missing_tracker(folder, found) if found else f"{folder} holds no {TRACKER}")
    saved = folder / iteration_name(tracker)
    if not saved.is_dir():
        raise LayoutError(f"{folder / TRACKER} names {tracker!r}, but {saved.name}/ is missing from {folder}")
    if not (saved / DIST_METADATA).is_file():
        raise LayoutError(
            f"{saved} is not a torch_dist checkpoint: it has no {DIST_METADATA}, which "
            f"megatron.core.dist_checkpointing writes (Megatron-LM's --ckpt-format torch_dist)"
        )
    return saved


@dataclass(frozen=True)
class LoadState:
    """What a ``--load`` folder holds: nothing (``fresh``), a resumable iteration of ours (``resume``), or a
    Megatron-LM ``release`` checkpoint whose weights a fresh run starts from (``weights``)."""

    resume: int | None = None
    weights: Path | None = None

    @property
    def fresh(self) -> bool:
        return self.resume is None and self.weights is None


def load_state(path: str | os.PathLike) -> LoadState:
    """What ``--load path`` starts from; ``LayoutError`` for a partial save."""
    folder = Path(path)
    if not folder.exists():
        return LoadState()
    if not folder.is_dir():
        raise LayoutError(f"not a folder: {folder}")
    tracker = read_tracker(folder)
    if tracker is None:
        found = saved_folders(folder)
        if found:
            raise LayoutError(_missing_tracker(folder, found))
        return LoadState()
    if tracker == RELEASE:
        return LoadState(weights=torch_dist_folder(folder))
    saved = folder / iteration_name(tracker)
    if not saved.is_dir():
        raise LayoutError(f"{folder / TRACKER} names iteration {tracker}, but {saved.name}/ is missing from {folder}")
    if not (saved / COMPLETE).is_file():
        if (saved / DIST_METADATA).is_file():
            raise LayoutError(
                f"{saved} is Megatron-LM's own save_checkpoint output, which --load does not resume here (it "
                f"resumes the checkpoints --save writes); give it as --ref-load to start from its weights"
            )
        raise LayoutError(f"{folder / TRACKER} names iteration {tracker}, but {saved} is incomplete (no COMPLETE)")
    return LoadState(resume=tracker)
