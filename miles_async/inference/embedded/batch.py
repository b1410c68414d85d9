"""The running batch of the embedded engine: its rows and the ``DynamicCache`` they share.

Rows are left padded to a common length and padding is hidden by a 2-D attention mask, with
explicit ``position_ids`` so every row sees the positions it would see alone. Each decode step
is one forward pass of shape ``[B, 1]`` for all rows. New requests are prefilled in their own
(left padded) forward pass and then merged into the running batch by left-padding the shorter
of the two caches with zeros (masked, hence inert). Finished rows are dropped with a batch
index-select of the cache, and all-padding columns on the left are trimmed.

Owned by the decode thread: no locking.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_async.inference.embedded.kv_cache import select_rows
from miles_async.inference.embedded.records import Seq


def prefill_inputs(contexts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, position ids) of ``contexts`` left padded to the longest."""
    longest = max(len(ctx) for ctx in contexts)
    ids = torch.full((len(contexts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), longest), dtype=torch.long)
    for i, ctx in enumerate(contexts):
        ids[i, longest - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        mask[i, longest - len(ctx) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class KVBatch:
    """The rows being decoded, their shared cache and its mask (``[B, L]`` long, 1 = real token)."""

    def __init__(self) -> None:
        self.rows: list[Seq] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None

    def add(self, seqs: list[Seq], cache: Any, mask: torch.Tensor) -> None:
        """Append freshly prefilled rows (their cache and mask) after the running ones."""
        self.rows.extend(seqs)
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        old_len, new_len = self.mask.shape[1], mask.shape[1]
        total = max(old_len, new_len)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat(
                [_left_pad(mine.keys, total - old_len, 2), _left_pad(theirs.keys, total - new_len, 2)]
            )
            mine.values = torch.cat(
                [_left_pad(mine.values, total - old_len, 2), _left_pad(theirs.values, total - new_len, 2)]
            )
        self.mask = torch.cat([_left_pad(self.mask, total - old_len, 1), _left_pad(mask, total - new_len, 1)])

    def drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if not s.finished]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.clear()
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        mask = self.mask.index_select(0, idx)
        # Columns that are padding for every surviving row cost compute each
        # step; cut them off.
        first = int(mask.any(dim=0).to(torch.int8).argmax())
        select_rows(self.cache, idx, first)
        self.mask = mask[:, first:]

    def clear(self) -> list[Seq]:
        """Drop every row and the cache; returns the rows, in order."""
        rows = self.rows
        self.rows, self.cache, self.mask = [], None, None
        return rows

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last token, position, mask) of every row for the next decode step; the mask gains its column."""
        b = len(self.rows)
        last = torch.tensor([s.output[-1] for s in self.rows], dtype=torch.long)[:, None]
        positions = torch.tensor([s.context_len - 1 for s in self.rows], dtype=torch.long)[:, None]
        self.mask = torch.cat([self.mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        return last, positions, self.mask
