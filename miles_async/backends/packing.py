"""Micro-batches packed to a token budget, and the padded tensors one forward pass needs.

Layout of a micro-batch: prompts left-padded and responses right-padded, so every
response starts at the same column and ``logits_to_keep`` can skip the prompt logits
(most of the vocabulary-sized memory on short-answer tasks).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from miles_async.backends.shared_prefix import SharedPrefixLayout, shared_layout


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Split sample indices (in order) into micro-batches whose padded size fits ``max_tokens``.

    A sample longer than the budget gets a micro-batch of its own rather than failing.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], n
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]; a VLM's [3, B, P + R] (vision/rope.py)
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float: 1 where the token is trained
    max_response_len: int
    shared: SharedPrefixLayout | None = None  # the same rows with one copy of each prompt (shared_prefix.py)
    pixels: dict[str, torch.Tensor] | None = None  # a VLM's rows' images in row order: pixel_values, image_grid_thw
    routing: list | None = None  # --use-rollout-routing-replay: each row's routing record (backends/routing_replay.py)

    def padded_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, P + R]`` each: the row and the position in its sample of the token at each column (-1: padding)."""
        real = self.attention_mask.bool()
        rows = torch.arange(real.shape[0])[:, None].expand(real.shape)
        return rows, torch.where(real, real.long().cumsum(dim=1) - 1, -1)


def collate(
    prompts: list[list[int]],
    responses: list[list[int]],
    loss_masks: list[list[int]],
    pad_id: int = 0,
    share_prefix: bool = False,
    keys: list[Hashable] | None = None,
) -> MicroBatch:
    """One micro-batch of padded rows; with ``share_prefix`` also its shared-prefix layout, rows sharing a
    prompt where their ``keys`` are equal (``shared_prefix.prompt_keys``; default: the prompt's tokens)."""
    b = len(prompts)
    p = max(len(x) for x in prompts)
    r = max(1, max(len(x) for x in responses))
    ids = torch.full((b, p + r), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + r), dtype=torch.long)
    resp = torch.full((b, r), pad_id, dtype=torch.long)
    mask = torch.zeros((b, r), dtype=torch.float32)
    for i, (pr, rs, lm) in enumerate(zip(prompts, responses, loss_masks)):
        ids[i, p - len(pr) : p] = torch.tensor(pr, dtype=torch.long)
        attn[i, p - len(pr) : p] = 1
        if rs:
            ids[i, p : p + len(rs)] = torch.tensor(rs, dtype=torch.long)
            attn[i, p : p + len(rs)] = 1
            resp[i, : len(rs)] = torch.tensor(rs, dtype=torch.long)
            mask[i, : len(rs)] = torch.tensor(lm, dtype=torch.float32)
    # Positions count real tokens only, so left padding does not shift RoPE.
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)
    shared = shared_layout(prompts, responses, pad_id, keys) if share_prefix else None
    return MicroBatch(ids, attn, pos, resp, mask, r, shared)


def pad_rows(rows: list[list[float]], width: int, value: float = 0.0) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row[:width], dtype=torch.float32)
    return out


def even_out(micro_batches: list[list[int]], target: int) -> list[list[int]]:
    """``micro_batches`` split or padded to ``target`` entries (the largest count among the replicas), so that
    every rank runs as many passes (a sharded model's passes are collectives: FSDP's parameter gathers, the
    token exchange of expert parallelism). The largest micro-batch is halved while it has two rows; a rank with
    too few rows gets empty entries, on which it runs a throw-away pass."""
    out = [list(mb) for mb in micro_batches]
    while len(out) < target:
        big = max(range(len(out)), key=lambda k: len(out[k]), default=None)
        if big is None or len(out[big]) < 2:
            out.append([])
            continue
        rows = out[big]
        out[big : big + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return out
