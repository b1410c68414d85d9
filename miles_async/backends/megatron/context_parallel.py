"""Context parallelism's data path (--context-parallel-size): each sequence split over the CP ranks as Megatron splits
it, and the per-token log-probs and entropies gathered back whole.

Megatron cuts the sequence dimension into ``2 x CP`` equal chunks and gives CP rank ``r`` chunks ``r`` and
``2 x CP - 1 - r``: under a causal mask an early chunk attends to little and a late one to much, so pairing them
gives every rank the same attention work. Its CP attention (Transformer Engine's) then exchanges keys and values
between the ranks; everything else in the model works token by token on the rank's own chunks.

So each rank computes its tokens' log-probs (and entropies) from its own logits, against labels cut the same way
from the whole sequence (the next token of a chunk's last position lives in the next chunk, perhaps on another
rank), and ``gather`` puts every rank's tokens back in sequence order. The gather carries gradients: each rank then
computes the whole sequence's loss, identical on every CP rank, and its backward sends each token's gradient to the
rank that computed it, summed over the CP ranks' identical losses (a factor CP). Megatron's DDP averages gradients
over data parallel x CP ranks, which takes that factor out again: the step is the step without CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of a ``length``-token sequence (a multiple of ``2 x cp``) that CP rank ``rank`` holds, in the
    order it holds them: chunk ``rank``, then chunk ``2 x cp - 1 - rank``."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not cut into {2 * cp} equal chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """``t`` ``[B, S, ...]`` cut to this CP rank's positions, ``[B, S / cp, ...]``."""
    return t[:, local_positions(t.shape[1], cp, rank).to(t.device)]


def next_token_labels(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``[B, S]``: the token each position predicts (the next one; ``pad_id`` after the last)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad_id)], dim=1)


def gather(local: torch.Tensor, cp: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every CP rank's ``[B, S / cp, ...]`` put back in sequence order, ``[B, S, ...]``, on every rank; gradients
    flow back to the rank each token came from."""
    if cp == 1:
        return local
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(local.contiguous(), group=group)  # rank r's at index r
    length = local.shape[1] * cp
    order = torch.cat([local_positions(length, cp, r) for r in range(cp)]).to(local.device)
    whole = torch.cat(parts, dim=1)  # rank 0's positions, then rank 1's, ...
    return whole[:, torch.argsort(order)]
