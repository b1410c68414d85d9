"""Shared-prefix layout: the n responses of a GRPO group attend to one copy of their prompt.

A group's samples share their prompt tokens. Laid out one row per sample, every training pass (policy, old and
reference log-probs) computes the prompt n times. Here the rows of a micro-batch whose prompts are equal become one
sequence, ``[prompt | slot 0 | slot 1 | ...]``, each slot one response right-padded to the micro-batch's longest,
with a block mask: a prompt token sees the prompt tokens before it; a response token sees the whole prompt and its
own response up to itself, never another slot; a padding position sees only itself (a row of keys all masked
would make attention NaN). Positions restart after the prompt in every slot, so RoPE sees exactly the positions of
the unshared layout, and each token attends to the same keys: the log-probs are those of the unshared layout up
to float summation order, and the gradient of every response flows into the one copy of the prompt's activations.

Every sequence of a micro-batch has the same columns (prompts left-padded to the longest, slots of one width),
so the logits needed are one contiguous tail: the last prompt column (which predicts each response's first token)
and the slots. Packing by ``--max-tokens-per-gpu`` counts a shared prompt once (``pack_shared``).

Rows share a prompt when their prompt keys are equal: the tokens, and for a vision-language prompt its images too
(two pictures of one size give the same placeholder tokens). A VLM's sequences get their 3-D positions and their
images' pixels from ``miles_async.backends.fsdp.vision``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixLayout:
    input_ids: torch.Tensor  # [G, L], L = P + K * R
    attention_mask: torch.Tensor  # [G, 1, L, L] bool: True where the query (row) may attend to the key (column)
    position_ids: torch.Tensor  # [G, L]; a VLM's [3, G, L] once its images are attached
    logits_to_keep: int  # the tail of columns whose logits the log-probs need: K * R + 1
    sequence: torch.Tensor  # [B] the sequence (group) of each row of the micro-batch
    column: torch.Tensor  # [B, R] index into the kept logits predicting each response token
    source_row: torch.Tensor  # [G, L] the row (sample) whose token sits at each column; the prompt's: the group's first
    source_pos: torch.Tensor  # [G, L] that token's position in its sample, -1 for padding
    pixels: dict[str, torch.Tensor] | None = None  # a VLM's: each sequence's images in sequence order

    @property
    def blocks(self) -> tuple[int, int, int]:
        """(P, K, R): the prompt's columns, the slots a sequence has and each slot's width."""
        r = self.column.shape[1]
        k = (self.logits_to_keep - 1) // r
        return self.input_ids.shape[1] - k * r, k, r


def prompt_keys(prompts: list[list[int]], images: list[list[str]] | None = None) -> list[Hashable]:
    """What two rows must have equal to share their prompt: its tokens and its images."""
    if images is None:
        return [tuple(p) for p in prompts]
    return [(tuple(p), tuple(refs)) for p, refs in zip(prompts, images, strict=True)]


def group_rows(keys: list[Hashable]) -> list[list[int]]:
    """Row indices grouped by equal prompt key, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def shared_layout(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0, keys: list[Hashable] | None = None
) -> SharedPrefixLayout:
    groups = group_rows(keys if keys is not None else prompt_keys(prompts))
    p = max(len(x) for x in prompts)
    r = max(1, max(len(x) for x in responses))
    k = max(len(g) for g in groups)
    width = p + k * r
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    real = torch.zeros((len(groups), width), dtype=torch.bool)
    slot_of = torch.full((len(groups), width), -1, dtype=torch.long)  # -1: the prompt
    sequence = torch.zeros(len(prompts), dtype=torch.long)
    source_row = torch.zeros((len(groups), width), dtype=torch.long)
    source_pos = torch.full((len(groups), width), -1, dtype=torch.long)
    column = torch.zeros((len(prompts), r), dtype=torch.long)
    for g, rows in enumerate(groups):
        prompt = prompts[rows[0]]
        start = p - len(prompt)
        ids[g, start:p] = torch.tensor(prompt, dtype=torch.long)
        pos[g, start:p] = torch.arange(len(prompt))
        real[g, start:p] = True
        source_row[g, start:p] = rows[0]
        source_pos[g, start:p] = torch.arange(len(prompt))
        for j, row in enumerate(rows):
            lo = p + j * r
            slot_of[g, lo : lo + r] = j
            resp = responses[row]
            if resp:
                ids[g, lo : lo + len(resp)] = torch.tensor(resp, dtype=torch.long)
                real[g, lo : lo + len(resp)] = True
                source_row[g, lo : lo + len(resp)] = row
                source_pos[g, lo : lo + len(resp)] = len(prompt) + torch.arange(len(resp))
            pos[g, lo : lo + r] = len(prompt) + torch.arange(r)
            sequence[row] = g
            # Kept logits start at column p - 1: index 0 predicts the first response token of every slot.
            column[row, 1:] = torch.arange(j * r + 1, j * r + r)
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    same_slot = slot_of[:, :, None] == slot_of[:, None, :]
    key_is_prompt = (slot_of == -1)[:, None, :]
    visible = causal & (same_slot | key_is_prompt) & real[:, :, None] & real[:, None, :]
    visible |= torch.eye(width, dtype=torch.bool)  # padding sees itself
    return SharedPrefixLayout(ids, visible[:, None], pos, k * r + 1, sequence, column, source_row, source_pos)


def pack_shared(
    prompts: list[list[int]], response_lengths: list[int], max_tokens: int, keys: list[Hashable] | None = None
) -> list[list[int]]:
    """Split row indices (in order) into micro-batches whose shared layout fits ``max_tokens``: each distinct
    prompt counted once, as ``shared_layout`` lays it out. A row too long for the budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    counts: dict[Hashable, int] = {}
    p = r = k = 0
    keys = keys if keys is not None else prompt_keys(prompts)

    def size(p: int, r: int, k: int, sequences: int) -> int:
        return sequences * (p + k * max(r, 1))

    for i, (prompt, n, key) in enumerate(zip(prompts, response_lengths, keys, strict=True)):
        new_k = max(k, counts.get(key, 0) + 1)
        sequences = len(counts) + (key not in counts)
        if current and size(max(p, len(prompt)), max(r, n), new_k, sequences) > max_tokens:
            batches.append(current)
            current, counts, p, r, new_k = [], {}, 0, 0, 1
        current.append(i)
        counts[key] = counts.get(key, 0) + 1
        p, r, k = max(p, len(prompt)), max(r, n), new_k
    if current:
        batches.append(current)
    return batches


def row_logits(kept: torch.Tensor, layout: SharedPrefixLayout) -> torch.Tensor:
    """``[B, R, V]``: for each row and response token, the logits that predict it, from the kept tail
    ``[G, K * R + 1, V]`` of the shared sequences."""
    return kept[layout.sequence[:, None].to(kept.device), layout.column.to(kept.device)]
