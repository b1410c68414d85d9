"""Data parallelism over an explicit process group, for every training backend.

The replicas of a model split each optimizer step's samples between them and sum what the
loss needs over their group: torch's default (world) group on the torch backend, Megatron's
data-parallel group on the Megatron one (the tensor-parallel ranks of one replica see the same
samples, so they are one member here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

V = TypeVar("V")


@dataclass(frozen=True)
class DataParallel:
    """One replica's place among the data-parallel replicas."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: torch.distributed's default (world) group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"data-parallel rank {self.rank} is outside a group of {self.size}")


def shard(n: int, global_batch_size: int, dp: DataParallel) -> tuple[list[list[int]], list[int]]:
    """This replica's sample indices of each optimizer step (every ``dp.size``-th of the step's slice of
    ``global_batch_size`` of the ``n`` samples), and all of them in one list."""
    steps = [list(range(s, min(s + global_batch_size, n)))[dp.rank :: dp.size] for s in range(0, n, global_batch_size)]
    return steps, [i for step in steps for i in step]


def all_reduce_sum(value: float, dp: DataParallel, device: torch.device) -> float:
    """The sum of every replica's ``value`` (``device``: where the group's backend reduces, CUDA for NCCL)."""
    if dp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=dp.group)
    return float(t.item())


def all_reduce_max(value: int, dp: DataParallel, device: torch.device) -> int:
    """The largest of every replica's ``value``."""
    if dp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp.group)
    return int(t.item())


def all_gather_dict(part: dict[int, V], dp: DataParallel) -> dict[int, V]:
    """Every replica's ``{sample index: value}`` merged, so each holds the whole batch's."""
    if dp.size == 1:
        return part
    parts: list[dict[int, V]] = [{} for _ in range(dp.size)]
    dist.all_gather_object(parts, part, group=dp.group)
    return {k: v for p in parts for k, v in p.items()}


def all_gather_keys(part: dict[int, V], dp: DataParallel) -> list[int]:
    """The union of every replica's keys of ``part``, sorted."""
    if dp.size == 1:
        return sorted(part)
    parts: list[list[int]] = [[] for _ in range(dp.size)]
    dist.all_gather_object(parts, sorted(part), group=dp.group)
    return sorted({k for p in parts for k in p})
