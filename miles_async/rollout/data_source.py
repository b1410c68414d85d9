"""Prompt data: JSONL / Parquet loading with line-precise errors, and a resumable epoch iterator.

With --multimodal-keys a record's images are checked as the file loads (each must exist and decode) and kept by
reference: a path becomes absolute (relative ones are read from the data file's folder), a data: URI or base64
string stays as it is.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_async.config import DataConfig


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class PromptItem:
    uid: str
    prompt: Any  # a string, or a list of chat messages
    label: Any
    metadata: dict
    images: tuple[str, ...] = ()  # --multimodal-keys: the prompt's images by reference, in placeholder order
    # "file:line" of the record, for errors found after loading (a prompt's image placeholders); not its identity.
    where: str = field(default="", compare=False)


def _iter_records(path: str, flag: str) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line or row number, record); raise DataError naming file and line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{flag}: file not found: {path}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:
            raise DataError(f"{flag}: cannot read Parquet file {path}: {e}") from e
        for i, rec in enumerate(table.to_pylist(), start=1):
            yield i, rec
        return
    try:
        fh = p.open("r", encoding="utf-8")
    except OSError as e:
        raise DataError(f"{flag}: cannot open {path}: {e}") from e
    with fh:
        for i, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{flag}: {path}:{i}: invalid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise DataError(f"{flag}: {path}:{i}: expected a JSON object, got {type(rec).__name__}")
            yield i, rec


def _image_refs(rec: dict, key: str, where: str, base_dir: Path) -> tuple[str, ...]:
    """The record's images under --multimodal-keys' ``key``, each checked to load; DataError naming the record."""
    from miles_async.vision.images import ImageError, load_image, resolve_path

    if key not in rec:
        raise DataError(f"{where}: missing key '{key}' (--multimodal-keys image column); keys present: {sorted(rec)}")
    raw = rec[key]
    refs = [raw] if isinstance(raw, str) else raw
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise DataError(
            f"{where}: '{key}' (--multimodal-keys) must be an image reference or a list of them "
            f"(paths, data: URIs or base64), got {type(raw).__name__}"
        )
    out = []
    for i, ref in enumerate(refs):
        try:
            load_image(ref, base_dir)
        except ImageError as e:
            raise DataError(f"{where}: '{key}'[{i}]: {e}") from e
        is_path = not ref.startswith("data:") and resolve_path(ref, base_dir).is_file()
        out.append(str(resolve_path(ref, base_dir).resolve()) if is_path else ref)
    return tuple(out)


def load_prompts(
    path: str,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None = None,
    flag: str = "--prompt-data",
    image_key: str | None = None,
) -> list[PromptItem]:
    items: list[PromptItem] = []
    seen: set[str] = set()
    for line_no, rec in _iter_records(path, flag):
        if input_key not in rec:
            raise DataError(
                f"{flag}: {path}:{line_no}: missing key '{input_key}' (--input-key); keys present: {sorted(rec)}"
            )
        if label_key is not None and label_key not in rec:
            raise DataError(
                f"{flag}: {path}:{line_no}: missing key '{label_key}' (--label-key); keys present: {sorted(rec)}"
            )
        uid = str(rec.get("uid", f"{Path(path).name}:{line_no}"))
        if uid in seen:
            raise DataError(f"{flag}: {path}:{line_no}: duplicate uid '{uid}'")
        seen.add(uid)
        metadata = rec.get(metadata_key) if metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            raise DataError(
                f"{flag}: {path}:{line_no}: '{metadata_key}' (--metadata-key) must be an object, got "
                f"{type(metadata).__name__}"
            )
        where = f"{flag}: {path}:{line_no}"
        images = _image_refs(rec, image_key, where, Path(path).parent) if image_key else ()
        label = rec.get(label_key) if label_key else None
        items.append(PromptItem(uid, rec[input_key], label, metadata or {}, images, f"{path}:{line_no}"))
    if not items:
        raise DataError(f"{flag}: {path} holds no prompts")
    return items


def count_and_validate_prompts(
    path: str,
    input_key: str,
    label_key: str | None,
    flag: str,
    metadata_key: str | None = None,
    image_key: str | None = None,
) -> int:
    """The file's prompts, each record checked as a run loads it (its images opened under ``image_key``)."""
    return len(load_prompts(path, input_key, label_key, metadata_key, flag, image_key))


class DataSource:
    """Hands out ``batch_size`` prompts per rollout, epoch by epoch, in a reproducible order.

    The state is (epoch, offset): enough to resume with exactly the same order, since the
    permutation of each epoch is a pure function of (seed, epoch); plus the prompts given back
    (``give_back``): drawn by a rollout that had kept enough groups before they finished, they
    are handed out again, first and in their own epoch, so no prompt of an epoch is lost.
    """

    def __init__(self, cfg: DataConfig, batch_size: int, items: list[PromptItem] | None = None):
        self.cfg = cfg
        self.batch_size = batch_size
        self.items = (
            items
            if items is not None
            else load_prompts(
                cfg.path, cfg.input_key, cfg.label_key, cfg.metadata_key, image_key=getattr(cfg, "image_key", None)
            )
        )
        if len(self.items) < batch_size:
            raise DataError(f"--prompt-data: {len(self.items)} usable prompts, fewer than the batch {batch_size}")
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)
        self._index = {item.uid: i for i, item in enumerate(self.items)}
        self._given_back: deque[tuple[int, int]] = deque()  # (epoch, item index), handed out first

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed * 100_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        # The tail of an epoch shorter than a batch is skipped (drop_last), so every
        # rollout is a full batch and every epoch has the same number of rollouts.
        back = [self.items[self._given_back.popleft()[1]] for _ in range(min(self.batch_size, len(self._given_back)))]
        need = self.batch_size - len(back)
        if self.offset + need > len(self.items):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.offset : self.offset + need]
        self.offset += need
        return back + [self.items[i] for i in idx]

    def next_item(self) -> PromptItem:
        """One prompt at a time, epoch after epoch (the fully-async producer's access)."""
        if self.offset >= len(self.items):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        item = self.items[self._order[self.offset]]
        self.offset += 1
        return item

    def draw(self) -> tuple[int, PromptItem]:
        """One prompt and the epoch it counts in (dynamic sampling's access): a given-back prompt first, else
        the next one in order, epoch after epoch with no tail skipped."""
        if self._given_back:
            epoch, i = self._given_back.popleft()
            return epoch, self.items[i]
        item = self.next_item()
        return self.epoch, item

    def give_back(self, drawn: Iterable[tuple[int, PromptItem]]) -> None:
        """Prompts drawn (``draw``) but neither trained nor filtered: the next draws hand them out again, in
        the epoch they were drawn in."""
        for epoch, item in drawn:
            self._given_back.append((epoch, self._index[item.uid]))

    def num_given_back(self) -> int:
        return len(self._given_back)

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "offset": self.offset, "num_items": len(self.items)}
        if self._given_back:
            state["given_back"] = [[e, self.items[i].uid] for e, i in self._given_back]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_items") != len(self.items):
            raise DataError(
                f"--load: the checkpoint's data source had {state.get('num_items')} prompts, "
                f"--prompt-data now has {len(self.items)}"
            )
        given_back = deque()
        for epoch, uid in state.get("given_back", []):
            if uid not in self._index:
                raise DataError(f"--load: the checkpoint gives back prompt uid {uid!r}, which --prompt-data lacks")
            given_back.append((int(epoch), self._index[uid]))
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._epoch_order(self.epoch)
        self._given_back = given_back
