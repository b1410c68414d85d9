"""Pipeline stages (--pipeline-model-parallel-size): what one stage holds reaching the stages that need it.

Only the last stage computes logits, so log-probs and the loss's metrics are broadcast from it to the other
stages of its pipeline group (rank 0, which reports, is a first stage). Each stage holds its own layers, so an
export of the whole policy runs on every stage at once and each later stage sends its (HF name, tensor) pairs
to the first stage of its pipeline group, which yields them after its own, in stage order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Stages:
    """This rank's place in its pipeline group: stage ``rank`` of ``size``; ``ranks``: the group's global ranks
    by stage."""

    size: int = 1
    rank: int = 0
    group: Any = None
    ranks: tuple[int, ...] = (0,)

    @classmethod
    def current(cls) -> Stages:
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        size = ps.get_pipeline_model_parallel_world_size()
        ranks = tuple(dist.get_global_rank(group, s) for s in range(size)) if size > 1 else (dist.get_rank(),)
        return cls(size, ps.get_pipeline_model_parallel_rank(), group, ranks)

    def from_last(self, obj: T) -> T:
        """The last stage's ``obj``, on every stage of the group (every stage must call it)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group)
        return box[0]

    def to_first(self, named: Callable[[], NamedTensors], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's ``named()`` pairs, stage by stage, on the first stage; a later stage sends its own there
        and yields nothing. Every stage of the group must run it to the end."""
        if self.size == 1:
            yield from named()
            return
        if self.rank > 0:
            for name, t in named():
                dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=self.ranks[0], group=self.group)
                dist.send(t.contiguous(), dst=self.ranks[0], group=self.group)
            dist.send_object_list([None], dst=self.ranks[0], group=self.group)
            return
        yield from named()
        for src in self.ranks[1:]:
            while True:
                head: list = [None]
                dist.recv_object_list(head, src=src, group=self.group)
                if head[0] is None:
                    break
                name, shape, dtype = head[0]
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src=src, group=self.group)
                yield name, t
