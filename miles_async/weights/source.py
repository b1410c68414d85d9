"""What a training backend implements once for the weight path: its policy's tensors under HF names.

Reading them can be a collective (Megatron gathers each parameter over tensor parallelism), so every rank
that takes part must iterate to the end, while only one rank (global rank 0) uses what it reads.
``WeightSource.read`` is that rule, once, for every consumer: the routes, checksums, HF folders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class WeightSource:
    tensors: Callable[[], NamedTensors]  # a fresh pass over the (HF name, full tensor) pairs
    sends: bool  # this rank's pass is the one used (global rank 0)
    gathers: bool = False  # this rank takes part in the pass's collectives without using it

    def read(self, consume: Callable[[NamedTensors], T], default: T) -> T:
        """``consume(tensors)`` on the sending rank; a gathering rank drains a pass (its collectives);
        every rank but the sender returns ``default``."""
        if self.sends:
            return consume(self.tensors())
        if self.gathers:
            for _ in self.tensors():
                pass
        return default


def iter_buckets(
    named_tensors: NamedTensors, dtype: torch.dtype, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors (cast to the engine's dtype) into buckets of about ``bucket_bytes``, so an update never
    holds a second full copy. Each stays on its own device, uncopied if already in ``dtype``: a GPU tensor
    leaves the GPU only if its route needs the CPU (the http route's serialization), when it is sent."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach().to(dtype=dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
