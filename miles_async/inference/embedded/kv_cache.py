"""The embedded engine's KV cache: transformers' ``DynamicCache`` whose layers append in place.

A ``DynamicLayer`` grows by ``torch.cat`` on every forward pass, so each decode step copies every row's whole cache
of every layer once more: quadratic in the answer's length. Measured against that (``benchmarks/levers.py``'s
``kv-cache`` lever), it was not faster beyond noise at answers of 32 or 128 tokens, so the engine uses it only where
``model.GROWING_KV_CACHE`` says (off). A ``GrowingLayer`` keeps spare columns after its tokens and
writes new ones into them; it reallocates only when they run out, with room for a quarter more (at least
``MIN_SPARE`` columns), so an answer of N tokens costs O(log N) copies of the cache, not N.

``keys`` and ``values`` are views of the first ``length`` columns (a left-trimmed start included), so everything
that reads a ``DynamicLayer`` (the model's attention and masks, ``KVBatch``) reads a ``GrowingLayer`` the same;
assigning them (``KVBatch``'s merges) makes the assigned tensor the layer's storage, without spare columns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# The fewest spare columns a reallocation leaves: short answers then grow a prompt's cache once or twice.
MIN_SPARE = 32


def spare_columns(length: int) -> int:
    """Columns left free after ``length`` tokens when a layer reallocates: a quarter more, at least ``MIN_SPARE``
    (a bounded share of memory, and O(log N) reallocations over N tokens)."""
    return max(MIN_SPARE, length // 4)


class _Store:
    """One tensor ``[B, H, capacity, D]`` and the columns ``[start, end)`` that hold tokens."""

    __slots__ = ("data", "start", "end")

    def __init__(self, data: torch.Tensor | None) -> None:
        self.data = data
        self.start = 0
        self.end = data.shape[2] if self._holds_tokens() else 0

    def _holds_tokens(self) -> bool:
        # Not before the first update: a DynamicLayer starts from None or an empty placeholder, not [B, H, T, D].
        return self.data is not None and self.data.dim() == 4

    def view(self) -> torch.Tensor | None:
        if not self._holds_tokens():
            return self.data
        return self.data[:, :, self.start : self.end]

    def append(self, new: torch.Tensor) -> None:
        added = new.shape[2]
        if self._holds_tokens() and self.data.shape[2] - self.end >= added:
            self.data[:, :, self.end : self.end + added] = new
            self.end += added
            return
        kept = self.end - self.start
        length = kept + added
        data = new.new_empty(new.shape[0], new.shape[1], length + spare_columns(length), new.shape[3])
        if kept:
            data[:, :, :kept] = self.data[:, :, self.start : self.end]
        data[:, :, kept:length] = new
        self.data, self.start, self.end = data, 0, length

    def select(self, rows: torch.Tensor, first_column: int) -> None:
        # The spare columns come along: the rows kept go on appending in place.
        self.data = self.data.index_select(0, rows)
        self.start += first_column


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare columns instead of concatenating."""

    def __init__(self) -> None:
        self._keys, self._values = _Store(None), _Store(None)
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._keys.view()

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = _Store(tensor)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._values.view()

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = _Store(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.device = key_states.device
            self.is_initialized = True
        self._keys.append(key_states)
        self._values.append(value_states)
        return self.keys, self.values

    def select(self, rows: torch.Tensor, first_column: int = 0) -> None:
        """Keep the rows ``rows`` (in that order, repeats allowed) from column ``first_column`` on."""
        self._keys.select(rows, first_column)
        self._values.select(rows, first_column)


def new_cache(config: Any) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` made of ``GrowingLayer`` s (the model's layers must all be full-attention
    ``DynamicLayer`` s: ``CausalLM`` checks at start-up)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def select_rows(cache: DynamicCache, rows: torch.Tensor, first_column: int = 0) -> None:
    """Keep the cache rows ``rows`` (in that order, repeats allowed) from column ``first_column`` on; a plain
    ``DynamicLayer`` (transformers' own cache, the levers benchmark's before) by a copy of what it holds."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.select(rows, first_column)
        else:
            layer.keys = layer.keys.index_select(0, rows)[:, :, first_column:]
            layer.values = layer.values.index_select(0, rows)[:, :, first_column:]
